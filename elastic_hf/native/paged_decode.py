"""ctypes binding of paged_decode.c: fp32 decode attention that reads K/V in place from the KV arena."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import load_library

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


@cache
def _kernel():
    lib = load_library("paged_decode")
    if lib is None:
        return None
    fn = lib.elastic_paged_decode_f32
    fn.argtypes = [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64,
                   _int, _int, _int, _int, _int, _int, _float, _int]
    fn.restype = _int
    return fn


def native_decode_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and _kernel() is not None


def paged_decode_attention(q: torch.Tensor, kv_chunks: torch.Tensor, chunk_table: torch.Tensor,
                           layer_chunk_offset: int, ctx_lens: torch.Tensor, out: torch.Tensor,
                           num_kv_heads: int, scale: float) -> None:
    """Writes the attention output of one decode token per sequence into `out`.

    q:           [S, num_heads, head_dim] fp32, head_dim contiguous (seq and head strides may be anything)
    kv_chunks:   [num_chunks, block_size, head_dim] fp32, contiguous (KVPagePool.chunks)
    chunk_table: [S * num_kv_heads * 2 * max_blocks] int64, contiguous: chunk ids of layer 0 ordered
                 (seq, kv head, K/V, block); only the first ceil(ctx_len / block_size) blocks are read
    ctx_lens:    [S] int64, contiguous, each in [1, max_blocks * block_size]
    out:         [S, num_heads, head_dim] fp32, head and head_dim contiguous"""
    num_seqs, num_heads, head_dim = q.shape
    block_size = kv_chunks.shape[1]
    max_blocks = chunk_table.numel() // max(1, num_seqs * num_kv_heads * 2)
    if q.stride(2) != 1:
        q = q.contiguous()
    if out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"out must have contiguous heads, got strides {tuple(out.stride())}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if chunk_table.numel() != num_seqs * num_kv_heads * 2 * max_blocks or ctx_lens.numel() != num_seqs:
        raise ValueError(f"chunk_table has {chunk_table.numel()} ids and ctx_lens {ctx_lens.numel()} entries for "
                         f"{num_seqs} sequences x {num_kv_heads} kv heads")
    status = _kernel()(q.data_ptr(), q.stride(0), q.stride(1), kv_chunks.data_ptr(), chunk_table.data_ptr(),
                       layer_chunk_offset, ctx_lens.data_ptr(), out.data_ptr(), out.stride(0),
                       num_seqs, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale,
                       torch.get_num_threads())
    if status == -2:
        raise ValueError(f"the native decode kernel takes head_dim <= 1024, got {head_dim}")
    if status != 0:
        raise MemoryError(f"paged decode attention could not allocate its score buffer "
                          f"({max_blocks * block_size} floats per thread)")
