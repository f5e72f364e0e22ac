"""ctypes binding of causal_prefill.c: causal attention of prompt chunks against their whole contexts (a chunk's
tokens are its context's last ones), all of one step's chunks of a layer in one call."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)   # bf16 is widened by the caller: the kernel computes in fp32


@cache
def _kernel():
    return bind("causal_prefill", "elastic_causal_prefill_varlen_f32",
                [_int] + [_ptr] * 7 + [_int, _int, _int, _float, _int], _int)


def native_prefill_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and _kernel() is not None


def _int64s(values: list[int]):
    return (_i64 * len(values))(*values)


def causal_prefill_attention_batch(queries: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                                   outs: list[torch.Tensor], scale: float) -> None:
    """For every sequence s, writes softmax(q k^T * scale, causal) v into outs[s]; query row i of a chunk sits at
    position ctx - q_len + i. All fp32 (widen bf16 before: once per step, not per sequence).

    queries[s]: [q_len, num_heads, head_dim]   any token / head strides (views of the projection outputs)
    keys/values[s]: [ctx, num_kv_heads, head_dim]  ctx >= q_len; num_heads a multiple of num_kv_heads (HF's repeat_kv
                                                  order)
    outs[s]:    [q_len, num_heads, head_dim]   head_dim contiguous"""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native causal prefill kernel is not available (no C compiler or ELASTIC_HF_NATIVE=0)")
    num_heads, head_dim = queries[0].shape[1], queries[0].shape[2]
    num_kv_heads = keys[0].shape[1]
    strides: list[int] = []
    for q, k, v, out in zip(queries, keys, values, outs, strict=True):
        if (k.shape != v.shape or k.shape[0] < q.shape[0] or q.shape[1:] != (num_heads, head_dim)
                or k.shape[1:] != (num_kv_heads, head_dim) or out.shape != q.shape):
            raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                             f"out {tuple(out.shape)}")
        if any(t.dtype != torch.float32 for t in (q, k, v, out)):
            raise ValueError(f"the kernel takes fp32 tensors, got {q.dtype}, {k.dtype}, {v.dtype}, {out.dtype}")
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
    """One sequence (see causal_prefill_attention_batch); takes fp32 or bf16 (widened here) and writes `out` in
    q's dtype."""
    if q.dtype != torch.float32:
        out32 = torch.empty(out.shape, dtype=torch.float32)
        causal_prefill_attention_batch([q.float()], [k.float()], [v.float()], [out32], scale)
        out.copy_(out32)
        return
    causal_prefill_attention_batch([q], [k], [v], [out], scale)
