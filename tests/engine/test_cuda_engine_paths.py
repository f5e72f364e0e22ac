"""The engine's CUDA paths that the rest of the suite covers only on the CPU: prefix caching (cached answers equal
uncached ones, cached-token counts), structured output (the token bitmask applied to logits on the GPU, sampled rows
drawn on the host; outputs parse and a fresh matcher accepts every token), and a KV cache that grows under load
while the controller morphs layers to W4 in the CUDA arena and shrinks back when the load ends. The checkpoints
carry tokenizers that need no default model (a GPU machine has none); each check is a function of the device so that
it can also be run on a CPU by hand."""
from __future__ import annotations

import json
import re

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.structured_outputs import StructuredOutputsParams as Constraint
from tiny_models import build_tiny_checkpoint

BLOCK = 16
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["kind", "ok", "n"], "additionalProperties": False}
# Layers of ~13 MiB (hidden 512, MLP 2048, fp32): a CUDA arena maps 2 MiB pages, and a swap to W4 must give whole
# pages back to the KV cache.
WIDE = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def byte_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("cuda-paths") / "llama", tokenizer="bytes",
                                 num_hidden_layers=3)


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory):
    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("cuda-wide") / "llama", tokenizer="bytes",
                                 num_hidden_layers=3, **WIDE)


def _prompts(num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 259, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g).tolist()
            for _ in range(num)]


def check_prefix_cache(checkpoint, device: str) -> None:
    """A conversation whose turns extend the previous ones: answers with the cache equal those without it, and each
    turn finds the full blocks the previous turns computed."""
    options = dict(device=device, kv_cache_memory=16 << 20, dtype="float32")
    with ElasticModel.from_pretrained(str(checkpoint), enable_prefix_caching=False, **options) as plain, \
            ElasticModel.from_pretrained(str(checkpoint), **options) as model:
        prompt_plain, prompt, turns = [], [], _prompts(4, 20, 40, seed=3)
        for turn in turns:
            prompt_plain, prompt = prompt_plain + turn, prompt + turn
            want = plain.generate(prompt_plain, max_tokens=8, ignore_eos=True).outputs[0].token_ids
            out = model.generate(prompt, max_tokens=8, ignore_eos=True)
            assert out.outputs[0].token_ids == want
            # the previous turn computed KV for all of its prompt but its answer's last token
            computed = 0 if turn is turns[0] else len(prompt) - len(turn) - 1
            assert out.num_cached_tokens == min(computed, len(prompt) - 1) // BLOCK * BLOCK
            prompt_plain, prompt = prompt_plain + want, prompt + list(out.outputs[0].token_ids)
        assert model.memory_report()["prefix_cache"]["hit_tokens"] > 0


def check_structured_output(checkpoint, device: str) -> None:
    """JSON schema, regex and choice constraints; batched with an unconstrained request, sampled and greedy."""
    with ElasticModel.from_pretrained(str(checkpoint), device=device, kv_cache_memory=16 << 20,
                                      max_model_len=512) as model:
        grammars = model.deployment.input_processor.grammars
        cases = [(Constraint(json=SCHEMA), lambda t: set(json.loads(t)) == {"kind", "ok", "n"}),
                 (Constraint(regex=r"\d{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
                 (Constraint(choice=["alpha", "beta gamma"]), lambda t: t in ("alpha", "beta gamma"))]
        dep = model.deployment
        for constraint, valid in cases:
            for params in (dict(temperature=0.0), dict(temperature=1.0, seed=5, n=2)):
                # an unconstrained request in the same steps: the mask must touch only the constrained rows
                ids = [dep.add_request(None, [1, 40, 50], SamplingParams(max_tokens=60, structured_outputs=constraint,
                                                                         **params)),
                       dep.add_request(None, [1, 60], SamplingParams(max_tokens=60, **params))]
                done = {}
                while len(done) < 2:
                    done.update({o.request_id: o for o in dep.step() if o.finished})
                for o in done[ids[0]].outputs:
                    assert o.finish_reason == "stop" and valid(o.text), (constraint, o.text)
                    state = grammars.compile(constraint).state()
                    assert all(state.consume(t) for t in o.token_ids)
                assert all(len(o.token_ids) > 0 for o in done[ids[1]].outputs)


def check_kv_grows_under_load(checkpoint, device: str) -> None:
    """Requests of 4 blocks, three times what the full-precision cache holds: the controller morphs layers to
    W4, the KV cache takes the freed pages and admits the queue; once idle, every layer is restored and the cache is
    its old size (also where that cache is smaller than a W4 slot: the last restore must not wait for room it can
    never get), and the model decodes as before the load."""
    from morph.morph_helpers import FAST_CONTROLLER, assert_bit_identical, snapshot, tiny_morph_model

    from elastic_hf.memory import default_page_size

    # the KV cache: 10 blocks, or one arena page where a page holds more (2 MiB on CUDA: ~21 blocks)
    with ElasticModel.from_pretrained(str(checkpoint), device=device, kv_cache_memory=64 << 20) as roomy:
        block_bytes = roomy.memory_report()["kv_block_bytes"]
        kv_bytes = max(10 * block_bytes, default_page_size(torch.device(device)))
        # requests of 4 blocks (48 prompt + 16 new tokens), three times what the full-precision cache holds
        num_requests = 3 * (kv_bytes // block_bytes // 4) + 3
        prompts = [list(range(10 + k, 58 + k)) for k in range(num_requests)]
        want = [roomy.generate(p, max_tokens=16, ignore_eos=True).outputs[0].token_ids for p in prompts[:3]]
    model = tiny_morph_model(str(checkpoint), device=device, morph="default", kv_cache_memory=kv_bytes,
                             max_num_seqs=64, controller=FAST_CONTROLLER)
    original = snapshot(model)
    engine = model.instances[0].engine
    fp_blocks = model.worker.pool.num_blocks
    assert fp_blocks * 2 < num_requests * 4, f"{fp_blocks} blocks hold half the requests: no pressure"
    for k, prompt in enumerate(prompts):
        engine.add_request(f"q{k}", prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    peak_blocks, finished = fp_blocks, {}
    while engine.requests:
        finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        peak_blocks = max(peak_blocks, model.worker.pool.num_blocks)
    state = model.morph.state()
    assert state["swaps"].get("fp->w4", 0) >= 1 and peak_blocks > fp_blocks, (state["swaps"], peak_blocks)
    # tokens decoded while layers ran at W4 may differ from the roomy run's
    assert sorted(finished) == sorted(f"q{k}" for k in range(num_requests))
    assert all(len(tokens) == 16 for tokens in finished.values())
    swapper = model.worker.morph.swapper
    for _ in range(400):   # idle steps: what the server's engine thread does once the load has gone
        if model.morph.state()["layer_counts"]["fp"] == 3 and not swapper.busy:
            break
        engine.step()
    assert model.morph.state()["layer_counts"]["fp"] == 3 and model.worker.pool.num_blocks == fp_blocks, \
        (model.morph.state(), model.worker.pool.num_blocks, fp_blocks)
    assert_bit_identical(model, original)
    # one request at a time (the cache holds one without pressure, three would make the controller morph again):
    # restored layers and the shrunk cache decode as before the load
    for k in range(3):
        assert model.generate(prompts[k], max_tokens=16, ignore_eos=True).outputs[0].token_ids == want[k]
    assert model.morph.state()["layer_counts"]["fp"] == 3
    model.close()


@pytest.mark.gpu
def test_prefix_cache_on_cuda(byte_checkpoint):
    check_prefix_cache(byte_checkpoint, "cuda")


@pytest.mark.gpu
def test_structured_output_on_cuda(byte_checkpoint):
    check_structured_output(byte_checkpoint, "cuda")


# on the CPU as well: the arena's pages differ (4 KiB vs 2 MiB), and the last restore's room is the same question
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_kv_cache_grows_under_load_and_shrinks_back(wide_checkpoint, device):
    check_kv_grows_under_load(wide_checkpoint, device)
