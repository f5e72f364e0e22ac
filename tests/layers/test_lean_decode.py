"""The lean decode step (layers/lean_decode.py): in a decode-only step a switched layer whose parts are all packed
and native runs as one C call of its kernels (native/lean_layer.c), and the engine's logits equal those of the fused forward (and so HF's
forward) bit for bit, fp32 and bf16, with and without biases, fused products or (a morphing instance) linears packed
one by one; steps with a prefill and morphed layers keep the fused forward; a layer's plan follows a morph and back;
ELASTIC_HF_LEAN_DECODE is checked."""
import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.layers import fused_decoder_layer, lean_decode
from elastic_hf.model.loader import load_hf_model
from greedy_reference import mixed_prompts, step_logits

MAX_NEW = 8


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Layers wide enough that fp32 packs every linear (576 x 576 and up), as the default model's."""
    from tiny_models import build_tiny_checkpoint

    def build(arch: str):
        return build_tiny_checkpoint(arch, tmp_path_factory.mktemp("lean") / arch, 0, hidden_size=576,
                                     intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9,
                                     num_key_value_heads=3)
    return build


def _run(model, prompts, lean: bool, monkeypatch) -> tuple[list[torch.Tensor], list[bool]]:
    """Every step's logits, and for every lean attempt whether it ran (True) or fell back, with its step kind (a
    layer a lean run computed counts as an attempt that ran)."""
    attempts = []

    def counted(layer, hidden_states, cos, sin, batch):
        out = lean_decode.lean_decode_forward(layer, hidden_states, cos, sin, batch)
        if out is not hidden_states:   # (a layer a lean run computed passes it through: counted with the run)
            ctx = batch.scratch
            computed = 1 + (len(ctx.run_rest) if out is not None and ctx.run_out is out else 0)
            attempts.extend([(out is not None, not batch.prefills)] * computed)
        return out

    monkeypatch.setattr(fused_decoder_layer, "lean_decode_enabled", lambda: lean)
    monkeypatch.setattr(fused_decoder_layer, "lean_decode_forward", counted)
    return step_logits(model, prompts, MAX_NEW), attempts


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "bfloat16")])   # Qwen2: q/k/v biases
def test_lean_decode_steps_give_the_fused_forwards_logits_bit_for_bit(wide, arch, dtype, monkeypatch):
    path = wide(arch)
    _, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 4, 3, 40, seed=3)
    logits = {}
    for lean in (False, True):   # a model each: the second run would hit the first's prefix cache
        with ElasticModel.from_pretrained(path, dtype=dtype, kv_cache_memory=8 << 20,
                                          max_num_batched_tokens=32) as model:
            attn = model.worker.loaded.layers[0].self_attn
            if getattr(attn.q_proj, "fused", None) is None or attn.q_proj.fused.direct is None:
                pytest.skip(f"this CPU's {dtype} linears are not read by native/decode_gemm.c (no layout it reads)")
            logits[lean], attempts = _run(model, prompts, lean, monkeypatch)
    fused, lean = logits[False], logits[True]
    assert len(fused) == len(lean) > MAX_NEW
    for a, b in zip(fused, lean):
        assert torch.equal(a, b)
    ran = [decode_only for taken, decode_only in attempts if taken]
    assert len(ran) >= 2 * (MAX_NEW - 2) and all(ran)                  # decode-only steps, every layer
    assert any(not decode_only for taken, decode_only in attempts if not taken)   # a prefill step kept the fused path


def test_a_morphing_instances_full_precision_layers_are_lean_and_its_morphed_ones_are_not(wide, monkeypatch):
    """A morphing instance packs each linear alone (HF's MLP stays): its fp layers run lean (q/k/v and gate/up as
    separate products into one buffer, HF's SiLU), a W8 layer keeps the fused forward, and the logits equal the
    fused forward's bit for bit, before and after the morph."""
    path = wide("llama")
    _, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 3, 3, 30, seed=4)
    logits, taken = {}, {}
    for morphed in (False, True):
        for lean in (False, True):
            with ElasticModel.from_pretrained(path, kv_cache_memory=8 << 20, max_num_batched_tokens=32,
                                              morph="manual", morph_options={"precisions": ("w8",)}) as model:
                if getattr(model.worker.loaded.layers[0].self_attn.q_proj, "direct", None) is None:
                    pytest.skip("this CPU's fp32 linears are not read by native/decode_gemm.c")
                if morphed:
                    model.morph.to_precision([1], "w8")
                logits[morphed, lean], attempts = _run(model, prompts, lean, monkeypatch)
            taken[morphed, lean] = [t for t, decode_only in attempts if decode_only]
        for a, b in zip(logits[morphed, False], logits[morphed, True]):
            assert torch.equal(a, b)
    assert taken[False, True] and all(taken[False, True])              # both fp layers, every decode step
    assert taken[True, True].count(True) == taken[True, True].count(False) > 0   # layer 0 lean, the W8 layer 1 not
    assert any(not torch.equal(a, b) for a, b in zip(logits[False, True], logits[True, True]))   # W8 changed them


def test_a_layers_plan_follows_it_across_a_morph_and_back(wide, monkeypatch):
    """A layer's plan (its weights' addresses, kept across steps) is rebuilt when its parts change: after a morph to
    W8 that layer falls back, after the morph back it runs lean again on its restored weights, and the logits equal
    those of the run before the morph bit for bit (prefix caching off, so the three runs take the same steps)."""
    path = wide("llama")
    _, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 3, 3, 30, seed=5)
    with ElasticModel.from_pretrained(path, kv_cache_memory=8 << 20, max_num_batched_tokens=32, morph="manual",
                                      morph_options={"precisions": ("w8",)}, enable_prefix_caching=False) as model:
        if getattr(model.worker.loaded.layers[0].self_attn.q_proj, "direct", None) is None:
            pytest.skip("this CPU's fp32 linears are not read by native/decode_gemm.c")
        before, attempts = _run(model, prompts, True, monkeypatch)
        assert all(t for t, decode_only in attempts if decode_only)
        model.morph.to_precision([1], "w8")
        morphed, attempts = _run(model, prompts, True, monkeypatch)
        taken = [t for t, decode_only in attempts if decode_only]
        assert taken.count(True) == taken.count(False) > 0               # layer 0 lean, the W8 layer 1 not
        model.morph.to_precision([1], "fp")
        after, attempts = _run(model, prompts, True, monkeypatch)
        assert all(t for t, decode_only in attempts if decode_only)
    assert len(before) == len(after)
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert any(not torch.equal(a, b) for a, b in zip(before, morphed))


def test_kernel_times_are_kept_only_while_asked(wide, monkeypatch):
    """time_kernels (benchmarks/step_profile.py's view inside the C layer call) adds each kernel kind's seconds while
    on, and the steps after it is off add nothing."""
    from elastic_hf.native import lean_layer

    path = wide("llama")
    _, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 2, 3, 20, seed=6)
    with ElasticModel.from_pretrained(path, kv_cache_memory=8 << 20, max_num_batched_tokens=32) as model:
        if getattr(model.worker.loaded.layers[0].self_attn.q_proj, "fused", None) is None:
            pytest.skip("this CPU's fp32 linears are not read by native/decode_gemm.c")
        seconds = lean_decode.time_kernels(True)
        try:
            _, attempts = _run(model, prompts, True, monkeypatch)
        finally:
            assert lean_decode.time_kernels(False) is None
        assert any(taken for taken, _ in attempts)
        for op in (lean_layer.OP_NORM, lean_layer.OP_GEMM, lean_layer.OP_ROTARY, lean_layer.OP_KV_WRITE,
                   lean_layer.OP_ATTEND, lean_layer.OP_SILU, lean_layer.OP_RESIDUAL):
            assert seconds[op] > 0, lean_layer.OP_NAMES[op]
        assert seconds[lean_layer.OP_GEMM] > seconds[lean_layer.OP_RESIDUAL]
        kept = list(seconds)
        _run(model, prompts, True, monkeypatch)
        assert list(seconds) == kept


def test_the_setting_is_checked(monkeypatch):
    lean_decode.lean_decode_enabled.cache_clear()
    try:
        monkeypatch.setenv(lean_decode.LEAN_DECODE_ENV_VAR, "0")
        assert not lean_decode.lean_decode_enabled()
        lean_decode.lean_decode_enabled.cache_clear()
        monkeypatch.setenv(lean_decode.LEAN_DECODE_ENV_VAR, "yes")
        with pytest.raises(ValueError, match="ELASTIC_HF_LEAN_DECODE='yes'"):
            lean_decode.lean_decode_enabled()
    finally:
        lean_decode.lean_decode_enabled.cache_clear()
