"""ctypes binding of rotary.c: HF's apply_rotary_pos_emb for one layer's queries and keys in one pass, fp32 and
bf16, bit-identical to eager torch."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _kernels() -> dict | None:
    argtypes = [_ptr, _i64, _i64, _i64] * 2 + [_ptr, _ptr, _i64] + [_ptr, _i64, _i64] * 2 + [_i64, _i64, _int]
    kernels = {dtype: bind("rotary", f"elastic_rotary_{suffix}", argtypes, _int) for dtype, suffix in _SUFFIX.items()}
    return None if None in kernels.values() else kernels


def rotary_entry(dtype: torch.dtype):
    """The bound C entry `apply_rotary` calls (element strides), for callers that computed every argument themselves
    (layers/lean_decode.py)."""
    return _kernels()[dtype]


def native_rotary_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _SUFFIX and _kernels() is not None


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [1, q_heads, T, head_dim], k: [1, k_heads, T, head_dim] (any strides, head_dim contiguous); cos, sin:
    [1, T, head_dim] (head_dim contiguous); all of one dtype. Returns (q_embed, k_embed) of q's and k's shapes,
    laid out token-major ([1, T, heads, head_dim] memory, as eager torch lays out the product of such views)."""
    kernel = _kernels()[q.dtype]
    _, q_heads, tokens, head_dim = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty(1, tokens, q_heads, head_dim, dtype=q.dtype).transpose(1, 2)   # [1, q_heads, T, hd]
    k_out = torch.empty(1, tokens, k_heads, head_dim, dtype=k.dtype).transpose(1, 2)
    kernel(q.data_ptr(), q.stride(1), q.stride(2), q_heads, k.data_ptr(), k.stride(1), k.stride(2), k_heads,
           cos.data_ptr(), sin.data_ptr(), cos.stride(1),
           q_out.data_ptr(), q_out.stride(1), q_out.stride(2), k_out.data_ptr(), k_out.stride(1), k_out.stride(2),
           tokens, head_dim, torch.get_num_threads())
    return q_out, k_out
