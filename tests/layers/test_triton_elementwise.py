"""The Triton elementwise kernels (native/triton_elementwise.py) against HF's eager modules on a GPU: RMSNorm equal
up to the order of its sum of squares, silu-and-mul bit for bit in bf16, the rotary embedding within the rounding of
its products (the H100 runs found 1-ulp differences on some bf16 elements; fp32: within 1e-5); a CUDA model gets
them switched in at build."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _needs_triton():
    pytest.importorskip("triton")


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, exact_bf16: bool) -> None:
    if dtype == torch.bfloat16 and exact_bf16:
        assert torch.equal(a, b)
    else:
        rtol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_hf(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from elastic_hf.native.triton_elementwise import rms_norm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5).to("cuda", dtype)
    norm.weight.data.normal_(1, 0.1)
    for rows in (1, 7, 300):
        x = torch.randn(rows, 576, device="cuda", dtype=dtype) * 3
        got, want = rms_norm(x, norm.weight, 1e-5), norm(x)
        _close(got, want, dtype, exact_bf16=False)
        if dtype == torch.bfloat16:   # rounding differs only where the sum's order tips it: rarely
            assert (got == want).float().mean() > 0.98
    strided = torch.randn(4, 2 * 576, device="cuda", dtype=dtype)[:, :576]
    _close(rms_norm(strided, norm.weight, 1e-5), norm(strided), dtype, exact_bf16=False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_eager(dtype):
    from elastic_hf.native.triton_elementwise import silu_and_mul

    torch.manual_seed(1)
    for rows, inter in ((1, 1536), (33, 1536), (5, 3000)):
        gate_up = torch.randn(rows, 2 * inter, device="cuda", dtype=dtype) * 4
        gate, up = gate_up[:, :inter], gate_up[:, inter:]    # strided halves, as a fused product gives them
        _close(silu_and_mul(gate, up), torch.nn.functional.silu(gate) * up, dtype, exact_bf16=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_rotary_matches_hf(dtype, head_dim):
    import transformers.models.llama.modeling_llama as llama

    from elastic_hf.native.triton_elementwise import apply_rotary

    eager = getattr(llama.apply_rotary_pos_emb, "__wrapped__", llama.apply_rotary_pos_emb)
    torch.manual_seed(2)
    for tokens in (1, 9, 200):
        # the engine's packed layout: [1, heads, T, head_dim] views of a [1, T, heads * head_dim] projection
        q = torch.randn(1, tokens, 9 * head_dim, device="cuda", dtype=dtype).view(1, tokens, 9, head_dim)
        k = torch.randn(1, tokens, 3 * head_dim, device="cuda", dtype=dtype).view(1, tokens, 3, head_dim)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        angles = torch.randn(1, tokens, head_dim // 2, device="cuda") * 50
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        (q_got, k_got), (q_want, k_want) = apply_rotary(q, k, cos, sin), eager(q, k, cos, sin)
        for x, got, want in ((q, q_got, q_want), (k, k_got, k_want)):
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                continue
            # bf16: within the rounding of the two products and their sum (a sum that cancels is small, the
            # products' rounding is not), i.e. a wrong index or formula fails, an ulp here and there does not
            xf, rot = x.float(), torch.cat([-x[..., head_dim // 2:], x[..., :head_dim // 2]], -1).float()
            bound = ((xf * cos.unsqueeze(1).float()).abs() + (rot * sin.unsqueeze(1).float()).abs()) * 2 ** -7 \
                + want.float().abs() * 2 ** -8
            assert ((got.float() - want.float()).abs() <= bound).all()
        if tokens > 1:   # (a size-1 dimension's stride means nothing)
            assert q_got.stride() == q_want.stride()


def test_a_cuda_model_runs_the_fused_kernels(tmp_path):
    import transformers.models.llama.modeling_llama as llama

    from elastic_hf import ElasticModel
    from elastic_hf.layers.native_norm import NativeRMSNorm
    from elastic_hf.layers.swiglu_mlp import SplitSwiGLUMLP
    from tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", tmp_path / "llama", tokenizer="minimal", num_hidden_layers=2)
    with ElasticModel.from_pretrained(str(path), device="cuda", kv_cache_memory=8 << 20) as model:
        modules = list(model.worker.hf_model.modules())
        assert sum(isinstance(m, NativeRMSNorm) for m in modules) == 2 * 2 + 1
        assert sum(isinstance(m, SplitSwiGLUMLP) for m in modules) == 2
        assert getattr(llama.apply_rotary_pos_emb, "elastic_native", False)
