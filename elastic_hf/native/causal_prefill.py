"""ctypes binding of causal_prefill.c: causal attention of one prompt chunk against its whole context (the chunk's
tokens are the context's last ones)."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import load_library

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)   # bf16 is widened here: the kernel computes in fp32


@cache
def _kernel():
    lib = load_library("causal_prefill")
    if lib is None:
        return None
    fn = lib.elastic_causal_prefill_f32
    fn.argtypes = [_ptr, _i64, _i64] * 4 + [_i64, _i64, _int, _int, _int, _float, _int]
    fn.restype = _int
    return fn


def native_prefill_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in SUPPORTED_DTYPES and _kernel() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as fp32 with head_dim contiguous (a bf16 input is widened: [T, heads, head_dim], small next to the
    T x T work)."""
    if x.dtype != torch.float32:
        return x.float()
    return x if x.stride(2) == 1 else x.contiguous()


def causal_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             scale: float) -> None:
    """Writes softmax(q k^T * scale, causal) v into `out`; query row i sits at position ctx - q_len + i.

    q:   [q_len, num_heads, head_dim]   any token / head strides (views of the projection outputs)
    k/v: [ctx, num_kv_heads, head_dim]  ctx >= q_len; num_heads a multiple of num_kv_heads (HF's repeat_kv order)
    out: [q_len, num_heads, head_dim]   q's dtype, head_dim contiguous"""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the native causal prefill kernel is not available (no C compiler or ELASTIC_HF_NATIVE=0)")
    num_queries, num_heads, head_dim = q.shape
    num_keys, num_kv_heads = k.shape[0], k.shape[1]
    if k.shape != v.shape or num_keys < num_queries or k.shape[2] != head_dim or out.shape != q.shape:
        raise ValueError(f"shapes do not match: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"out {tuple(out.shape)}")
    if out.stride(2) != 1:
        raise ValueError(f"out must have head_dim contiguous, got strides {tuple(out.stride())}")
    q32, k32, v32 = _rows(q), _rows(k), _rows(v)
    out32 = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32)
    status = kernel(q32.data_ptr(), q32.stride(0), q32.stride(1), k32.data_ptr(), k32.stride(0), k32.stride(1),
                    v32.data_ptr(), v32.stride(0), v32.stride(1), out32.data_ptr(), out32.stride(0),
                    out32.stride(1), num_queries, num_keys, num_heads, num_kv_heads, head_dim, scale,
                    torch.get_num_threads())
    if status == -2:
        raise ValueError(f"the native prefill kernel takes head_dim <= 256 and num_heads a multiple of "
                         f"num_kv_heads, got head_dim {head_dim}, {num_heads} heads, {num_kv_heads} kv heads")
    if status != 0:
        raise MemoryError(f"causal prefill attention could not allocate K^T scratch "
                          f"({num_kv_heads} x {head_dim} x {num_keys} floats)")
    if out32 is not out:
        out.copy_(out32)
