"""Precision morphing inside the running engine: decoding continues across swaps without recomputation,
memory moves from weights to KV (ledger and RSS), the controller morphs under a load that exhausts the fp KV
cache and restores when it ends, and forced morphs never touch running requests' KV or other layers."""
from __future__ import annotations

import random

import pytest
import torch

from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.memory import process_rss_bytes
from morph_helpers import FAST_CONTROLLER, assert_bit_identical, snapshot, tiny_morph_model, weights_read

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _settled_rss() -> int:
    """RSS after returning freed heap to the OS, so that only arena pages move between two readings."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    return process_rss_bytes()


def _step_until(engine, predicate, limit=500, what=lambda: None):
    outputs = []
    for _ in range(limit):
        if predicate():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError(f"condition not reached in {limit} steps: {what()}")


# Llama, and the families whose layers differ most: Qwen3 (q/k norms), Gemma 3 (four norms, window and global
# layers), Phi-3 (fused qkv/gate_up Linears quantized whole) and Qwen3-MoE (attention quantized, experts kept); the
# other families in the slow tier.
_FAST_FAMILIES = ["llama", "qwen3", "gemma3_text", "phi3", "qwen3_moe"]
_OTHER_FAMILIES = ["qwen2", "mistral", "gemma2", "olmo2", "granite", "mixtral"]


@pytest.mark.parametrize("arch", _FAST_FAMILIES + [pytest.param(a, marks=pytest.mark.slow) for a in _OTHER_FAMILIES])
def test_decoding_continues_across_w4_and_back_without_recompute(arch, tiny_checkpoint):
    # The prompt runs twice (reference, then the morphed run): no prefix cache, so every prompt token is prefilled.
    model = tiny_morph_model(tiny_checkpoint(arch), enable_prefix_caching=False)
    original = snapshot(model)
    prompt = list(range(3, 40))
    reference = model.generate(prompt, max_tokens=16, ignore_eos=True).outputs[0].token_ids
    engine = model.instances[0].engine
    computed_before = engine.num_computed_prompt_tokens
    engine.add_request("r", prompt, SamplingParams(max_tokens=16, **GREEDY))
    seq = engine.requests["r"].seqs[0]
    _step_until(engine, lambda: seq.num_output_tokens >= 5)
    fp_tokens = list(seq.output_token_ids)
    model.morph.to_precision("all", "w4")            # between two steps: a step boundary
    _step_until(engine, lambda: seq.num_output_tokens >= 10)
    model.morph.to_precision("all", "fp")
    _step_until(engine, lambda: not engine.has_unfinished_requests())
    assert fp_tokens == reference[:5]                 # tokens produced at full precision equal the untouched run
    assert len(seq.output_token_ids) == 16 and seq.num_preemptions == 0
    assert engine.num_computed_prompt_tokens - computed_before == len(prompt)  # no re-prefill
    assert_bit_identical(model, original)
    assert model.generate(prompt, max_tokens=16, ignore_eos=True).outputs[0].token_ids == reference


@pytest.mark.slow
def test_default_model_memory_moves_from_weights_to_kv():
    """k layers of SmolLM2-135M to W4: the ledger drops by exactly k x (fp region - W4 slot); RSS by the same
    within 5 % + 2 MiB (heap noise); the KV cache grows by every whole block beyond the headroom."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(None, kv_cache_memory=32 << 20, morph="manual", dtype="float32",
                                         morph_options={"precisions": ("w4",)})
    k = 6
    placement = model.worker.weights.placement
    weights_before = model.worker.budget.used_bytes("weights")
    blocks_before = model.worker.pool.num_blocks
    free_before = model.worker.budget.free_bytes
    rss_before = _settled_rss()
    state = model.morph.to_precision(list(range(k)), "w4")
    rss_after = _settled_rss()
    expected = sum(placement.layers[i].nbytes - placement.slots[i]["w4"].nbytes for i in range(k))
    assert weights_before - model.worker.budget.used_bytes("weights") == expected
    assert abs((rss_before - rss_after) - expected) <= 0.05 * expected + (2 << 20), (rss_before - rss_after,
                                                                                      expected)
    block_bytes = model.worker.pool.layout.block_bytes
    grown = (free_before + expected - state["headroom_bytes"]) // block_bytes
    assert model.worker.pool.num_blocks - blocks_before == grown
    # ~14.2 MB fp32 layer vs ~2.2 MB W4 image: each layer gives ~32 blocks of 16 tokens
    assert expected > k * 11_000_000
    model.morph.to_precision("all", "fp")
    assert model.worker.budget.used_bytes("weights") == weights_before
    assert model.worker.pool.num_blocks == blocks_before


def test_controller_morphs_under_kv_exhaustion_and_restores_when_load_ends(tiny_checkpoint):
    model = tiny_morph_model(tiny_checkpoint("llama"), morph="default", kv_cache_memory=10 * 12288,
                             max_num_seqs=32,
                             # The fp cache stalls at 8 of 10 blocks (80 % < 85 %) with the queue head unable to
                             # get its 3 blocks: the queue-delay trigger must fire.
                             controller=FAST_CONTROLLER)
    original = snapshot(model)
    engine = model.instances[0].engine
    fp_blocks = model.worker.pool.num_blocks
    # 12 requests of 4 blocks each: the fp cache holds 2 of them at a time
    for k in range(12):
        engine.add_request(f"q{k}", list(range(10 + k, 58 + k)), SamplingParams(max_tokens=16, **GREEDY))
    peak_running, peak_blocks, finished = 0, fp_blocks, []
    while engine.requests:
        finished += [o for o in engine.step() if o.finished]
        peak_running = max(peak_running, len(engine.scheduler.running))
        peak_blocks = max(peak_blocks, model.worker.pool.num_blocks)
    state = model.morph.state()
    diagnostics = (state["swaps"], peak_blocks, peak_running, fp_blocks, list(model.morph.manager().decisions),
                   state["last_error"], state["controller_enabled"])
    assert state["swaps"].get("fp->w4", 0) >= 1, diagnostics
    assert peak_blocks > fp_blocks and peak_running > fp_blocks // 4, diagnostics  # queued requests got admitted
    assert len(finished) == 12 and all(len(o.outputs[0].token_ids) == 16 for o in finished)
    # load is gone: idle steps (what the server's engine thread does) let the controller restore everything
    swapper = model.worker.morph.swapper
    _step_until(engine, lambda: model.morph.state()["layer_counts"]["fp"] == 3 and not swapper.busy,
                limit=400, what=lambda: (model.morph.state()["layer_counts"], list(model.morph.manager().decisions)))
    assert model.worker.pool.num_blocks == fp_blocks
    assert not engine.has_unfinished_requests()
    assert_bit_identical(model, original)


def test_forced_morphs_never_touch_running_requests(tiny_checkpoint):
    model = tiny_morph_model(tiny_checkpoint("llama"), kv_cache_memory=64 * 12288)
    engine = model.instances[0].engine
    rng = random.Random(0)
    for k in range(4):
        engine.add_request(f"f{k}", list(range(5 + k, 40 + 7 * k)), SamplingParams(max_tokens=24, **GREEDY))
    rows = model.worker.pool.rows
    rows_per_block = model.worker.pool.layout.rows_per_block
    outputs = []
    precisions = ("fp", "w8", "w4")
    while engine.requests:
        outputs += engine.step()
        live = sorted({b for s in engine.scheduler.running for b in s.block_ids})
        kv_before = {b: rows[b * rows_per_block:(b + 1) * rows_per_block].clone() for b in live}
        layers = sorted(rng.sample(range(3), rng.randint(1, 3)))
        precision = rng.choice(precisions)
        untouched = {n: p.detach().clone() for i in set(range(3)) - set(layers)
                     for n, p in weights_read(model.worker.loaded.layers[i]).items()}
        model.morph.to_precision(layers, precision)
        for b, data in kv_before.items():
            assert torch.equal(rows[b * rows_per_block:(b + 1) * rows_per_block], data), f"KV block {b} changed"
        remaining = {n: p for i in set(range(3)) - set(layers)
                     for n, p in weights_read(model.worker.loaded.layers[i]).items()}
        for name, value in untouched.items():
            assert torch.equal(remaining[name], value)
        assert engine.scheduler.kv.num_used == sum(len(s.block_ids) for s in engine.scheduler.running)
    finished = [o for o in outputs if o.finished]
    assert len(finished) == 4 and all(len(o.outputs[0].token_ids) == 24 for o in finished)
    assert engine.scheduler.num_preemptions == 0


def test_lis_profile_sets_the_swap_order(tiny_checkpoint, tmp_path):
    import json

    from transformers import AutoConfig

    from elastic_hf.profiling.profile_format import PROFILE_FORMAT, config_hash

    checkpoint = tiny_checkpoint("llama")
    profile = tmp_path / "lis.json"
    profile.write_text(json.dumps({
        "format": PROFILE_FORMAT, "model_id": "tiny", "config_hash": config_hash(AutoConfig.from_pretrained(checkpoint)),
        "num_layers": 3, "quant_scheme": {"quant": "w4", "group_size": 64, "method": "rtn"}, "order": [2, 0, 1]}))
    model = tiny_morph_model(checkpoint, morph="performance", profile=str(profile),
                             controller=dict(persistence_steps=1, window_steps=1, layers_per_step=1))
    manager = model.morph.manager()
    assert manager.order == [2, 0, 1] and manager.controller.order == [2, 0, 1]
    with pytest.raises(ValueError, match="profile='/nope.json' does not exist"):
        tiny_morph_model(checkpoint, morph="default", profile="/nope.json")
