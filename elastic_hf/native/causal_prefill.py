"""ctypes binding of causal_prefill.c: causal attention of prompt chunks against their whole contexts (a chunk's
tokens are its context's last ones), all of one step's chunks of a layer in one call. fp32 tensors, or bf16 ones
where the build has the bf16 path (AVX512-BF16, head_dim 64 or 128: `bf16_prefill_takes`); elsewhere a caller widens
bf16 to fp32."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind
from elastic_hf.native.decode_gemm import bf16_dot_chosen

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)   # bf16 without the bf16 path is widened by the caller
_ARGTYPES = [_int] + [_ptr] * 7 + [_int, _int, _int, _float, _int]
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _kernel(dtype: torch.dtype = torch.float32):
    return bind("causal_prefill", f"elastic_causal_prefill_varlen_{KERNEL_DTYPES[dtype]}", _ARGTYPES, _int)


@cache
def bf16_prefill_takes(head_dim: int) -> bool:
    """Whether bf16 q/k/v of this head_dim go to the kernel as they are (its vdpbf16ps path) rather than widened:
    where the build has that path and vdpbf16ps runs at an FMA's rate here (decode_gemm.bf16_dot_chosen, measured
    once a process; ELASTIC_HF_BF16_DOT=0 turns both off). The path issues 1.5x the fp32 kernel's FMAs in dot
    instructions (QK^T one, PV two: a probability as hi + lo), so on a CPU where they run at half rate (the Xeon of
    session 45) the widened fp32 kernel is the faster one."""
    takes = bind("causal_prefill", "elastic_causal_prefill_bf16_takes", [_int], _int)
    return takes is not None and bool(takes(head_dim)) and bf16_dot_chosen()


def widens(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether q/k/v of this dtype must be widened to fp32 for the kernel (bf16 without its bf16 path here)."""
    return dtype != torch.float32 and not (dtype == torch.bfloat16 and bf16_prefill_takes(head_dim))


def native_prefill_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and _kernel() is not None


def _int64s(values: list[int]):
    return (_i64 * len(values))(*values)


def causal_prefill_attention_batch(queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                                   outs: list[torch.Tensor], scale: float) -> None:
    """For every sequence s, writes softmax(q k^T * scale, causal) v into outs[s]; query row i of a chunk sits at
    position ctx - q_len + i. All fp32, or all bf16 where `bf16_prefill_takes(head_dim)` (else widen bf16 before:
    once per step, not per sequence).

    queries[s]: [q_len, num_heads, head_dim]   any token / head strides (views of the projection outputs)
    keys/values[s]: [ctx, num_kv_heads, head_dim]  ctx >= q_len; num_heads a multiple of num_kv_heads (HF's repeat_kv
                                                  order)
    outs[s]:    [q_len, num_heads, head_dim]   head_dim contiguous"""
    dtype = queries[0].dtype
    kernel = _kernel(dtype) if dtype in KERNEL_DTYPES else None
    if kernel is None:
        raise RuntimeError("the native causal prefill kernel is not available (no C compiler or ELASTIC_HF_NATIVE=0)")
    num_heads, head_dim = queries[0].shape[1], queries[0].shape[2]
    if dtype == torch.bfloat16 and not bf16_prefill_takes(head_dim):
        raise ValueError(f"the prefill kernel takes no bf16 at head_dim {head_dim} here (its bf16 path: AVX512-BF16 "
                         f"builds, head_dim 64 or 128, vdpbf16ps at an FMA's rate): widen to fp32")
    num_kv_heads = keys[0].shape[1]
    strides: list[int] = []
    for q, k, v, out in zip(queries, keys, values, outs, strict=True):
        if (k.shape != v.shape or k.shape[0] < q.shape[0] or q.shape[1:] != (num_heads, head_dim)
                or k.shape[1:] != (num_kv_heads, head_dim) or out.shape != q.shape):
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                             f"out {tuple(out.shape)}")
        if any(t.dtype != dtype for t in (q, k, v, out)):
            raise ValueError(f"the kernel takes tensors of one dtype (fp32 or bf16), got {q.dtype}, {k.dtype}, "
                             f"{v.dtype}, {out.dtype}")
        if any(t.stride(2) != 1 for t in (q, k, v, out)):
            raise ValueError(f"head_dim must be contiguous, got strides q {tuple(q.stride())}, k {tuple(k.stride())}, "
                             f"v {tuple(v.stride())}, out {tuple(out.stride())}")
        strides += [q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
                    out.stride(1)]
    status = kernel(len(queries), _int64s([t.data_ptr() for t in queries]), _int64s([t.data_ptr() for t in keys]),
                    _int64s([t.data_ptr() for t in values]), _int64s([t.data_ptr() for t in outs]), _int64s(strides),
                    _int64s([q.shape[0] for q in queries]), _int64s([k.shape[0] for k in keys]), num_heads,
                    num_kv_heads, head_dim, scale, torch.get_num_threads())
    if status == -2:
        raise ValueError(f"the native prefill kernel takes head_dim <= 256, num_heads a multiple of num_kv_heads and "
                         f"1 <= q_len <= ctx, got head_dim {head_dim}, {num_heads} heads, {num_kv_heads} kv heads")
    if status != 0:
        raise MemoryError(f"causal prefill attention could not allocate K^T scratch for {len(queries)} sequences "
                          f"({num_kv_heads} x {head_dim} x {sum(k.shape[0] for k in keys)} floats)")


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             scale: float) -> None:
    """One sequence (see causal_prefill_attention_batch); takes fp32 or bf16 (widened here where the kernel has no
    bf16 path for this head_dim) and writes `out` in q's dtype."""
    if widens(q.dtype, q.shape[2]):
        out32 = torch.empty(out.shape, dtype=torch.float32)
        causal_prefill_attention_batch([q.float()], [k.float()], [v.float()], [out32], scale)
        out.copy_(out32)
        return
    causal_prefill_attention_batch([q], [k], [v], [out], scale)
