"""ctypes binding of paged_decode.c: decode attention that reads fp32 or bf16 K/V in place from the KV arena."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p


# dtype of the queries, the KV arena and the outputs (one dtype for all three) -> exported entry point
_ENTRY_POINTS = {torch.float32: "elastic_paged_decode_f32", torch.bfloat16: "elastic_paged_decode_bf16"}


@cache
def _kernel(kv_dtype: torch.dtype):
    if kv_dtype not in _ENTRY_POINTS:
        return None
    return bind("paged_decode", _ENTRY_POINTS[kv_dtype],
                [_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _int, _int, _int, _int, _int, _int, _float,
                 _int], _int)


def decode_entry(kv_dtype: torch.dtype):
    """The bound C entry `paged_decode_attention` calls (None without one), for callers that computed every argument
    themselves (layers/lean_decode.py)."""
    return _kernel(kv_dtype)


def native_decode_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and _kernel(dtype) is not None


def paged_decode_attention(q: torch.Tensor, kv_chunks: torch.Tensor, chunk_table: torch.Tensor,
                           layer_chunk_offset: int, ctx_lens: torch.Tensor, out: torch.Tensor,
                           num_kv_heads: int, scale: float) -> None:
    """Writes the attention output of one decode token per sequence into `out`.

    q:           [S, num_heads, head_dim] in the KV dtype, head_dim contiguous (seq and head strides may be anything)
    kv_chunks:   [num_chunks, block_size, head_dim] fp32 or bf16, contiguous (KVPagePool.chunks)
    chunk_table: [S * num_kv_heads * 2 * max_blocks] int64, contiguous: chunk ids of layer 0 ordered
                 (seq, kv head, K/V, block); only the first ceil(ctx_len / block_size) blocks are read
    ctx_lens:    [S] int64, contiguous, each in [1, max_blocks * block_size]
    out:         [S, num_heads, head_dim] in the KV dtype, head and head_dim contiguous

    bf16 goes in and out as bf16 (the kernel computes in fp32 and rounds the output once): no widening copies.
    This runs once per layer per step, so it checks only what the kernel cannot survive."""
    num_seqs, num_heads, head_dim = q.shape
    kernel = _kernel(kv_chunks.dtype)
    if kernel is None:
        raise ValueError(f"no native decode kernel for {kv_chunks.dtype} K/V (fp32 and bf16 have one)")
    if q.dtype != kv_chunks.dtype or out.dtype != kv_chunks.dtype:
        raise ValueError(f"q ({q.dtype}) and out ({out.dtype}) must have the K/V dtype {kv_chunks.dtype}")
    if out.stride(2) != 1 or out.stride(1) != head_dim:
        raise ValueError(f"out must have contiguous heads, got strides {tuple(out.stride())}")
    if q.stride(2) != 1:
        q = q.contiguous()
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    max_blocks = chunk_table.numel() // max(1, num_seqs * num_kv_heads * 2)
    if chunk_table.numel() != num_seqs * num_kv_heads * 2 * max_blocks or ctx_lens.numel() != num_seqs:
        raise ValueError(f"chunk_table has {chunk_table.numel()} ids and ctx_lens {ctx_lens.numel()} entries for "
                         f"{num_seqs} sequences x {num_kv_heads} kv heads")
    status = kernel(q.data_ptr(), q.stride(0), q.stride(1), kv_chunks.data_ptr(), chunk_table.data_ptr(),
                    layer_chunk_offset, ctx_lens.data_ptr(), out.data_ptr(), out.stride(0),
                    num_seqs, num_heads, num_kv_heads, head_dim, kv_chunks.shape[1], max_blocks, scale,
                    torch.get_num_threads())
    check_decode_status(status, head_dim, max_blocks, kv_chunks.shape[1])


def check_decode_status(status: int, head_dim: int, max_blocks: int, block_size: int) -> None:
    """Raise for a non-zero status of the C entry (`decode_entry`)."""
    if status == -2:
        raise ValueError(f"the native decode kernel takes head_dim <= 1024, got {head_dim}")
    if status != 0:
        raise MemoryError(f"paged decode attention could not allocate its score buffer "
                          f"({4 * (max_blocks * block_size + 17)} floats per thread)")
