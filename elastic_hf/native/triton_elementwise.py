"""The elementwise work around a decoder layer's GEMMs on a GPU, in Triton: HF's RMSNorm, SwiGLU's silu(gate) * up
and the rotary embedding of queries and keys, each one launch instead of eager torch's chains of 1-2 us kernels
(RMSNorm 6-7, rotary ~12 for q and k, silu-and-mul 2). In a CUDA-graph-replayed decode step of a small model those
chains, not the GEMMs, set the step time (README, "GPU"). The CPU has the same three in C (fused_elementwise.c,
rotary.c).

Each kernel rounds where eager torch rounds (bf16: every product and sum that torch stores). On an H100 silu-and-mul
equals torch bit for bit in bf16, RMSNorm up to the order of its sum of squares (> 98 % of bf16 elements equal), and
the rotary embedding within one bf16 ulp on some elements (why is not established: each product is rounded as
torch rounds it; tests/layers/test_triton_elementwise.py). Sizes come from tensor shapes only and nothing syncs
with the host, so a captured step replays them. TRITON_INTERPRET=1 runs them on CPU tensors (fp32 only: the
interpreter truncates where bf16 rounds)."""
from __future__ import annotations

import os

import torch

from elastic_hf.native.fused_elementwise import rows_2d
from elastic_hf.native.triton_paged import _triton

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


# Triton reads it when the kernels below are defined (import time), so it is read once here too
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_elementwise_available(dtype: torch.dtype, device: torch.device) -> bool:
    """On CUDA with Triton installed (or on the CPU under TRITON_INTERPRET=1, for tests), for fp32/bf16/fp16."""
    on_device = device.type == "cuda" or (device.type == "cpu" and _INTERPRETED)
    return on_device and dtype in _DTYPES and _triton() is not None


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


# Module level, not inside a function: a Triton kernel resolves the other kernels it calls among its module's globals.
_TRITON = _triton()
if _TRITON is not None:
    triton, tl = _TRITON

    @triton.jit
    def _rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, out_stride, dim, eps, BLOCK: tl.constexpr):
        # one program per row: HF's LlamaRMSNorm, x.to(f32) * rsqrt(mean(x^2) + eps), back to x's dtype, times w
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(x * x, axis=0) / dim + eps)
        normed = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _silu_mul_kernel(gate_ptr, gate_stride, up_ptr, up_stride, out_ptr, out_stride, inter, BLOCK: tl.constexpr):
        # program (row, column tile): silu(gate) rounded to the dtype (torch stores it), times up, rounded
        row, tile = tl.program_id(0), tl.program_id(1)
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * out_stride + cols, (act * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotate(x_ptr, out_ptr, cos_ptr, sin_ptr, cs, d, mask, half):
        # out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product and the sum rounded to the
        # dtype, as eager torch stores them
        x1 = tl.load(x_ptr + d, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + half + d, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(cos_ptr + cs + d, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + cs + half + d, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + cs + d, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + cs + half + d, mask=mask, other=0.0).to(tl.float32)
        ty = out_ptr.dtype.element_ty
        lo = (x1 * c1).to(ty).to(tl.float32) + (-x2 * s1).to(ty).to(tl.float32)
        hi = (x2 * c2).to(ty).to(tl.float32) + (x1 * s2).to(ty).to(tl.float32)
        tl.store(out_ptr + d, lo.to(ty), mask=mask)
        tl.store(out_ptr + half + d, hi.to(ty), mask=mask)

    @triton.jit
    def _rotary_kernel(q_ptr, q_stride_h, q_stride_t, q_out_ptr, q_out_stride_h, q_out_stride_t, q_heads,
                       k_ptr, k_stride_h, k_stride_t, k_out_ptr, k_out_stride_h, k_out_stride_t,
                       cos_ptr, sin_ptr, cs_stride_t, half, HALF: tl.constexpr):
        # program (token, head of q then of k): one launch for both
        token, head = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, HALF)
        mask = d < half
        cs = token * cs_stride_t
        if head < q_heads:
            _rotate(q_ptr + head * q_stride_h + token * q_stride_t,
                    q_out_ptr + head * q_out_stride_h + token * q_out_stride_t, cos_ptr, sin_ptr, cs, d, mask, half)
        else:
            kh = head - q_heads
            _rotate(k_ptr + kh * k_stride_h + token * k_stride_t,
                    k_out_ptr + kh * k_out_stride_h + token * k_out_stride_t, cos_ptr, sin_ptr, cs, d, mask, half)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm of x [..., dim] with weight [dim] of x's dtype; returns a new tensor of x's shape."""
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{x.shape[-1]}] {x.dtype} tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    rows = rows_2d(x)                                        # [rows, dim]
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, rows.stride(0), weight, out, out.stride(0), rows.shape[1], eps,
                                           BLOCK=_next_pow2(rows.shape[1]))
    return out.view(x.shape)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., inter] of one dtype; returns [..., inter]."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up must match, got {tuple(gate.shape)} {gate.dtype} and "
                         f"{tuple(up.shape)} {up.dtype}")
    g, u = rows_2d(gate), rows_2d(up)                        # [rows, inter]
    out = torch.empty(g.shape, dtype=gate.dtype, device=gate.device)
    block = min(1024, _next_pow2(g.shape[1]))
    if g.shape[0]:
        _silu_mul_kernel[(g.shape[0], -(-g.shape[1] // block))](g, g.stride(0), u, u.stride(0), out, out.stride(0),
                                                                g.shape[1], BLOCK=block)
    return out.view(gate.shape)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [1, q_heads, T, head_dim], k: [1, k_heads, T, head_dim] (any strides, head_dim contiguous); cos, sin:
    [1, T, head_dim] of one stride (head_dim contiguous); one dtype. Returns (q_embed, k_embed) of q's and k's
    shapes, laid out token-major ([1, T, heads, head_dim] memory, as eager torch lays out the product of such
    views)."""
    tokens, head_dim = q.shape[2], q.shape[3]
    q_heads, k_heads = q.shape[1], k.shape[1]
    # token-major outputs, as eager torch lays out the product of the transposed views: [1, heads, T, head_dim]
    q_out = torch.empty(1, tokens, q_heads, head_dim, dtype=q.dtype, device=q.device).transpose(1, 2)
    k_out = torch.empty(1, tokens, k_heads, head_dim, dtype=k.dtype, device=k.device).transpose(1, 2)
    if tokens:
        half = head_dim // 2
        _rotary_kernel[(tokens, q_heads + k_heads)](
            q, q.stride(1), q.stride(2), q_out, q_out.stride(1), q_out.stride(2), q_heads,
            k, k.stride(1), k.stride(2), k_out, k_out.stride(1), k_out.stride(2),
            cos, sin, cos.stride(1), half, HALF=_next_pow2(half))
    return q_out, k_out
