"""The native rotary embedding (native/rotary.c, layers/native_rotary.py) against HF's apply_rotary_pos_emb of
every supported architecture: bit-identical in fp32 and bf16 for decode and prefill shapes, strided q/k views as
HF hands them over and real rotary tables; what the kernel does not take runs HF's original; an engine installs it
and keeps the greedy tokens it has with the original."""
import importlib

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.layers.native_rotary import use_native_rotary
from elastic_hf.native.rotary import apply_rotary, native_rotary_available
from elastic_hf.patches import get_adapter
from greedy_reference import mixed_prompts
from tiny_models import tiny_config, tiny_hf_model

pytestmark = pytest.mark.skipif(not native_rotary_available(torch.float32, torch.device("cpu")),
                                reason="no C compiler (or ELASTIC_HF_NATIVE=0): HF's rotary stays")

ARCHS = ("llama", "qwen2", "mistral")


def original_rotary(arch: str):
    """HF's own function, whether or not a test before this one installed the native version."""
    adapter = get_adapter(tiny_config(arch))
    function = getattr(importlib.import_module(adapter.modeling_module), adapter.rotary_function)
    return getattr(function, "__wrapped__", function)


def packed_qk(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """q and k as HF's attention makes them from a fused q/k/v product: [1, heads, T, hd] transposed views."""
    qkv = (torch.randn(1, tokens, (heads + 2 * kv_heads) * head_dim) * 3).to(dtype)
    q = qkv[..., :heads * head_dim].view(1, tokens, heads, head_dim).transpose(1, 2)
    k = qkv[..., heads * head_dim:(heads + kv_heads) * head_dim].view(1, tokens, kv_heads, head_dim).transpose(1, 2)
    return q, k


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bit_identical_to_hf(arch, dtype):
    torch.manual_seed(3)
    eager = original_rotary(arch)
    for tokens, heads, kv_heads, head_dim in ((1, 9, 3, 64), (32, 9, 3, 64), (7, 8, 2, 128), (700, 9, 3, 64),
                                              (33, 4, 4, 24)):
        model = tiny_hf_model(arch, hidden_size=heads * head_dim, num_attention_heads=heads,
                              num_key_value_heads=kv_heads, num_hidden_layers=1, vocab_size=64)
        q, k = packed_qk(tokens, heads, kv_heads, head_dim, dtype)
        positions = torch.randint(0, 4000, (1, tokens))          # scattered positions, as a packed batch has
        with torch.inference_mode():
            cos, sin = model.model.rotary_emb(q, positions)           # [1, T, hd] in q's dtype
            expected_q, expected_k = eager(q, k, cos, sin)
            got_q, got_k = apply_rotary(q, k, cos, sin)
        assert got_q.shape == expected_q.shape and got_k.shape == expected_k.shape
        assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k), (tokens, heads, head_dim)
        if tokens > 1:   # (one token's strides are arbitrary)
            assert got_q.stride() == expected_q.stride()   # token-major, as eager lays it out


def test_installed_version_falls_back_where_the_kernel_does_not_apply():
    adapter = get_adapter(tiny_config("llama"))
    assert use_native_rotary(adapter.modeling_module, adapter.rotary_function)
    module = importlib.import_module(adapter.modeling_module)
    native = module.apply_rotary_pos_emb
    assert native.elastic_native and use_native_rotary(adapter.modeling_module, adapter.rotary_function)
    assert module.apply_rotary_pos_emb is native                   # installed once, never wrapped twice
    eager = native.__wrapped__
    torch.manual_seed(4)
    q, k = packed_qk(5, 4, 2, 16, torch.float32)
    cos, sin = torch.randn(1, 5, 16), torch.randn(1, 5, 16)
    cases = [(q, k, cos, sin, 1),
             (q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), cos.expand(2, -1, -1), sin.expand(2, -1, -1), 1),
             (q.half(), k.half(), cos.half(), sin.half(), 1),                       # fp16: not the kernel's
             (q, k, cos.double(), sin.double(), 1),                                 # mixed dtypes
             (q.transpose(1, 2), k.transpose(1, 2), cos, sin, 2)]                   # HF's other layout
    for q_, k_, c_, s_, dim in cases:
        got, expected = native(q_, k_, c_, s_, dim), eager(q_, k_, c_, s_, dim)
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    leaf = q.clone().requires_grad_()
    out_q, _ = native(leaf, k, cos, sin)
    out_q.sum().backward()                                          # autograd went through HF's ops
    assert leaf.grad is not None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("native-rotary") / "qwen2", 0,
                                 hidden_size=128, num_hidden_layers=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_installs_it_and_keeps_its_greedy_tokens(checkpoint, dtype, monkeypatch):
    adapter = get_adapter(tiny_config("qwen2"))
    module = importlib.import_module(adapter.modeling_module)
    eager = getattr(module.apply_rotary_pos_emb, "__wrapped__", module.apply_rotary_pos_emb)
    from elastic_hf.model.loader import load_hf_model

    _, tokenizer = load_hf_model(checkpoint)
    prompts = mixed_prompts(tokenizer, 5, 3, 40, seed=6)
    with ElasticModel.from_pretrained(checkpoint, dtype=dtype, kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=48) as model:
        assert module.apply_rotary_pos_emb.elastic_native
        calls = []
        native = module.apply_rotary_pos_emb
        monkeypatch.setattr(module, "apply_rotary_pos_emb", lambda *a, **k: calls.append(1) or native(*a, **k))
        fast = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=8)]
        assert len(calls) > 0
        monkeypatch.setattr(module, "apply_rotary_pos_emb", eager)
        slow = [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=8)]
    assert fast == slow
