"""Multi-process tensor parallelism gives the greedy tokens of an unsharded model (fp32; the row-parallel
all-reduce sums partials in a different order, so logits differ by float round-off, tokens do not)."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.model.loader import load_hf_model
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 12


def _check(model: ElasticModel, reference, prompts, max_new=MAX_NEW):
    outputs = model.generate(prompts, max_tokens=max_new)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == hf_greedy(reference, prompt, max_new), \
            f"prompt of {len(prompt)} tokens diverged at topology {model.deployment.topology}"


def _hf_logprobs(model, ids):
    import torch

    with torch.inference_mode():
        return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def test_tp2_started_directly_with_uneven_kv_heads_and_biases_matches_hf(tp_checkpoint):
    # Qwen2 (q/k/v biases), 3 KV heads: rank 0 holds 2, rank 1 holds 1. Llama at TP2 is covered by test_reshape.
    path = tp_checkpoint("kv3", "qwen2")
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 6, 3, 80, seed=11)
    with ElasticModel.from_pretrained(path, workers=2, tp=2, kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=64) as model:  # chunked prefill shares steps
        _check(model, reference, prompts)
        # prompt logits of whole chunks come back from rank 0 through the pipe as well
        out = model.generate(prompts[-1], max_tokens=4, logprobs=1, prompt_logprobs=1)
        expected = _hf_logprobs(reference, prompts[-1] + out.outputs[0].token_ids)
        ids = prompts[-1][1:] + out.outputs[0].token_ids
        got = [r.logprob for r in out.prompt_logprobs[1:] + out.outputs[0].logprobs]
        assert got == pytest.approx([float(expected[i, t]) for i, t in enumerate(ids)], abs=1e-3)
        num_blocks = model.instances[0].engine.scheduler.kv.num_total
        assert [r["kv_blocks"] for r in model.memory_report()["workers"]] == [num_blocks, num_blocks]


@pytest.mark.outer_only  # four workers: the two-worker tests cover the same code and files
def test_tp4_and_tp2_plus_two_tp1_match_hf_across_reshapes(tp_checkpoint):
    """4 workers, 4 KV heads: [1,1,1,1] -> [4] -> [2,1,1] with requests decoding across both reshapes."""
    from elastic_hf.engine.sampling_params import SamplingParams

    path = tp_checkpoint("kv4")
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 8, 3, 60, seed=12)
    with ElasticModel.from_pretrained(path, workers=4, kv_cache_memory=2 << 20) as model:
        dep = model.deployment
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        ids = [dep.add_request(None, p, params) for p in prompts]
        done = run_steps(dep, ids, {}, num_steps=3)
        assert dep.reshape([4]).committed and [i.tp for i in dep.instances] == [4]
        run_steps(dep, ids, done, num_steps=3)
        assert dep.reshape([2, 1, 1]).committed and [i.tp for i in dep.instances] == [2, 1, 1]
        run_steps(dep, ids, done)
        assert [done[r] for r in ids] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
        assert dep.stats()["num_computed_prompt_tokens"] == sum(len(p) for p in prompts)  # no re-prefill


@pytest.mark.slow
def test_tp2_default_model_matches_hf():
    from elastic_hf.model.loader import resolve_model

    path = resolve_model(None, dtype="float32").checkpoint_dir
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 2, 5, 40, seed=13)
    with ElasticModel.from_pretrained(None, workers=2, tp=2, kv_cache_memory=32 << 20, dtype="float32") as model:
        _check(model, reference, prompts, max_new=6)
