"""The native causal prefill kernel (elastic_hf/native/causal_prefill.c) against SDPA on the same q/k/v: whole
prompts and chunks at the end of a longer context (up to several of its key spans), lengths that are not multiples
of its key / query blocks, the head sizes it specialises (64, 128) and generic ones, several GQA groups, strided
views of one packed projection (as HF hands them over), fp32 and bf16 (on the kernel's vdpbf16ps path where the
build has it, else widened); and a whole step's chunks in one call (the batch entry point), each with its own lengths
and strides, giving every sequence its own result, in both dtypes."""
import pytest
import torch
import torch.nn.functional as F

from elastic_hf.native import build
from elastic_hf.native.causal_prefill import (bf16_prefill_takes, causal_prefill_attention,
                                             causal_prefill_attention_batch, native_prefill_available)

pytestmark = pytest.mark.skipif(not build.native_enabled() or build._compiler() is None,
                                reason="no C compiler here (or ELASTIC_HF_NATIVE=0)")

# bf16: the products are exact in fp32 either way (on the vdpbf16ps path a probability enters as two bf16, ~16 bits):
# the error is the output's bf16 rounding
TOLERANCES = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}


def reference(q, k, v, scale):
    """SDPA in fp32 with the causal mask of queries at the end of the context. q: [q_len, H, hd], k/v: [ctx, KVH,
    hd] -> [q_len, H, hd]."""
    q_len, ctx = q.shape[0], k.shape[0]
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 9, 3), (128, 8, 2), (24, 4, 4), (48, 8, 1)])
# (70, 1300), (600, 1100): contexts of several key spans (KEY_SPAN 512), whose row groups take turns span by span
@pytest.mark.parametrize("q_len,ctx", [(1, 1), (7, 7), (33, 33), (100, 100), (5, 70), (40, 97), (1, 50), (70, 1300),
                                       (600, 1100)])
def test_kernel_matches_sdpa(head_dim, num_heads, num_kv_heads, q_len, ctx, dtype):
    assert native_prefill_available(dtype, torch.device("cpu"))
    torch.manual_seed(head_dim * 1000 + q_len * 7 + ctx)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    # one packed q|k|v projection output, as the fused product hands it over: every operand is a strided view
    packed = torch.randn(ctx, width).to(dtype)
    q = packed[ctx - q_len:, :num_heads * head_dim].view(q_len, num_heads, head_dim)
    k = packed[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(ctx, num_kv_heads, head_dim)
    v = packed[:, (num_heads + num_kv_heads) * head_dim:].view(ctx, num_kv_heads, head_dim)
    out = torch.full((q_len, num_heads, head_dim), float("nan"), dtype=dtype)
    scale = head_dim ** -0.5

    causal_prefill_attention(q, k, v, out, scale)

    torch.testing.assert_close(out.float(), reference(q, k, v, scale), **TOLERANCES[dtype])


def test_heads_that_do_not_divide_and_more_queries_than_keys_fail_clearly():
    q, out = torch.randn(4, 6, 16), torch.empty(4, 6, 16)
    with pytest.raises(ValueError, match="6 heads, 4 kv heads"):
        causal_prefill_attention(q, torch.randn(4, 4, 16), torch.randn(4, 4, 16), out, 0.25)
    with pytest.raises(ValueError, match=r"q \(4, 6, 16\), k \(3, 2, 16\)"):
        causal_prefill_attention(q, torch.randn(3, 2, 16), torch.randn(3, 2, 16), out, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_call_for_a_step_of_chunks_gives_each_its_own_result(dtype):
    """Whole prompts (views of one packed step projection) and chunks continuing a cached context (K/V gathered
    into tensors of their own strides), of lengths around the kernel's blocks, in one call."""
    torch.manual_seed(7)
    num_heads, num_kv_heads, head_dim = 9, 3, 64
    if dtype == torch.bfloat16 and not bf16_prefill_takes(head_dim):
        pytest.skip("no bf16 path here (no AVX512-BF16, or vdpbf16ps at half rate): bf16 is widened by the caller")
    lengths = [(1, 1), (16, 16), (37, 37), (5, 70), (33, 200), (1, 50), (120, 120)]   # (q_len, ctx)
    total = sum(q_len for q_len, _ in lengths)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    packed = torch.randn(total, width).to(dtype)                      # the step's q|k|v projection
    q_all = packed[:, :num_heads * head_dim].view(total, num_heads, head_dim)
    k_all = packed[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(total, num_kv_heads, head_dim)
    v_all = packed[:, (num_heads + num_kv_heads) * head_dim:].view(total, num_kv_heads, head_dim)
    out_all = torch.full((total, num_heads, head_dim), float("nan"), dtype=dtype)
    queries, keys, values, outs, start = [], [], [], [], 0
    for q_len, ctx in lengths:
        queries.append(q_all[start:start + q_len])
        outs.append(out_all[start:start + q_len])
        if q_len == ctx:
            keys.append(k_all[start:start + q_len])
            values.append(v_all[start:start + q_len])
        else:   # a cached context, head-major as gathered from the pages
            keys.append(torch.randn(num_kv_heads, ctx, head_dim).to(dtype).transpose(0, 1))
            values.append(torch.randn(num_kv_heads, ctx, head_dim).to(dtype).transpose(0, 1))
        start += q_len
    causal_prefill_attention_batch(queries, keys, values, outs, head_dim ** -0.5)
    for q, k, v, out in zip(queries, keys, values, outs):
        torch.testing.assert_close(out.float(), reference(q, k, v, head_dim ** -0.5), **TOLERANCES[dtype])


def test_dtypes_the_kernel_does_not_take_fail_clearly():
    q = torch.randn(4, 4, 24)
    with pytest.raises(ValueError, match="one dtype"):
        causal_prefill_attention_batch([q], [q.bfloat16()], [q], [torch.empty_like(q)], 0.25)
    with pytest.raises(ValueError, match="takes no bf16 at head_dim 24"):   # 64 and 128 only
        causal_prefill_attention_batch([q.bfloat16()], [q.bfloat16()], [q.bfloat16()], [q.bfloat16()], 0.25)


def test_bf16_path_is_as_accurate_as_the_widened_fp32_kernel():
    """The vdpbf16ps path's mean error against an fp32 reference is the widened fp32 kernel's (a probability rounded
    to one bf16 before the product with V made it 1.4x, enough to flip a random-weight model's greedy near-ties)."""
    if not bf16_prefill_takes(64):
        pytest.skip("no bf16 path here (no AVX512-BF16, or vdpbf16ps at half rate)")
    torch.manual_seed(3)
    q, k, v = torch.randn(400, 9, 64).bfloat16(), torch.randn(400, 3, 64).bfloat16(), torch.randn(400, 3, 64).bfloat16()
    expected = reference(q, k, v, 0.125)
    direct = torch.empty(400, 9, 64, dtype=torch.bfloat16)
    causal_prefill_attention_batch([q], [k], [v], [direct], 0.125)
    widened = torch.empty(400, 9, 64)
    causal_prefill_attention_batch([q.float()], [k.float()], [v.float()], [widened], 0.125)
    direct_error = (direct.float() - expected).abs().mean()
    widened_error = (widened.bfloat16().float() - expected).abs().mean()
    assert direct_error <= 1.05 * widened_error, (float(direct_error), float(widened_error))
