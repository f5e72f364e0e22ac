"""A CPU deployment's sharded linears keep their chunks packed for the native kernel (layers/shardable_linear.py):
with head_dim 64 and 64-row chunks every linear of every worker packs, and the greedy tokens stay HF's across a
drop (layers released, KV exchanged), a restore (layers loaded back from the host store and packed), a reshape to
TP2 (chunks gathered from the peer: plain on the wire, packed on arrival) and back to two TP1 instances, with
requests decoding across all four and no prompt token computed twice."""
import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from elastic_hf.native.decode_gemm import decode_gemm_available
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 10
LAYERS = 4
# head_dim 64 with 3 KV heads (TP2: 2 + 1): q/k/v/o chunks of 64-row multiples, MLP chunks of 256 rows
PACKABLE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=3,
                num_key_value_heads=3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def packable_checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("packed") / "llama", 0, **PACKABLE)


def test_packed_shards_keep_greedy_tokens_across_drop_restore_and_tp_reshapes(packable_checkpoint):
    reference, tokenizer = load_hf_model(packable_checkpoint)
    prompts = mixed_prompts(tokenizer, 8, 6, 50, seed=41)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with ElasticModel.from_pretrained(packable_checkpoint, workers=2, kv_cache_memory=8 << 20,
                                      max_num_batched_tokens=48) as model:
        expected = 7 * LAYERS if decode_gemm_available(torch.float32) else 0
        assert [w["packed_linears"] for w in model.memory_report()["workers"]] == [expected, expected]
        dep = model.deployment
        ids = [dep.add_request(None, p, params) for p in prompts]
        done = run_steps(dep, ids, {}, num_steps=2)
        assert model.drop() is not None and str(dep.topology).startswith("[1x2")
        done = run_steps(dep, ids, done, num_steps=6)
        assert model.restore() is not None and str(dep.topology) == "[1,1]"
        done = run_steps(dep, ids, done, num_steps=2)
        assert dep.reshape([2]).committed and [i.tp for i in dep.instances] == [2]
        done = run_steps(dep, ids, done, num_steps=2)
        assert dep.reshape([1, 1], weights_source="peers").committed and [i.tp for i in dep.instances] == [1, 1]
        done = run_steps(dep, ids, done)
        assert dep.num_computed_prompt_tokens == sum(map(len, prompts))
    assert [done[r] for r in ids] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
