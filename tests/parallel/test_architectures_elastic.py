"""TP and PP reshapes on the families whose layers differ most from Llama's: Qwen3 (per-head q/k norms), Gemma 3
(four (1 + w) norms, sliding-window and global layers, scaled embeddings), Granite (multipliers, one of them
inside the decoder's forward, which a later pipeline stage must not apply again) and Gemma 2 (soft-capped scores;
Mistral's one window for every layer is in test_pipeline.py). Requests decode across
[1,1] -> [2] -> 1x2 -> [1,1] and give the tokens of HF's untouched model with no prompt token computed twice; the
families that cannot shard are refused before any worker starts, naming why."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 16


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "granite", "gemma2"])
def test_decoding_across_tp_and_pp_reshapes_is_exact(arch, tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    # 4 layers, prompts past Gemma's 24-token window: window and global layers on both stages of the pipeline
    path = build_tiny_checkpoint(arch, tmp_path_factory.mktemp("arch") / arch, 0, num_hidden_layers=4)
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 5, 3, 80, seed=41)
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    with ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=1 << 20, max_num_batched_tokens=48,
                                      enable_prefix_caching=False) as model:
        dep = model.deployment
        before = dep.stats()["num_computed_prompt_tokens"]
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        ids = [dep.add_request(None, p, params) for p in prompts]
        done = run_steps(dep, ids, {}, num_steps=3)
        for target in ([2], ["1x2"], [1, 1]):
            assert dep.reshape(target).committed
            run_steps(dep, ids, done, num_steps=3)
        run_steps(dep, ids, done)
        assert [done[r] for r in ids] == expected
        assert dep.stats()["num_computed_prompt_tokens"] - before == sum(len(p) for p in prompts)


@pytest.mark.parametrize("arch,reason", [("phi3", "fuses q/k/v"), ("olmo2", "normalise over all heads"),
                                         ("qwen3_moe", "experts")])
def test_families_that_cannot_shard_are_refused_before_workers_start(arch, reason, tiny_checkpoint):
    with pytest.raises(ValueError, match=f"a deployment of 2 workers shards the weights.*{reason}"):
        ElasticModel.from_pretrained(tiny_checkpoint(arch), workers=2, kv_cache_memory=1 << 20)
