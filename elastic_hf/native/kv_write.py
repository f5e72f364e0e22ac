"""ctypes binding of kv_write.c: one layer's new K and V rows written into their pages in one call, read in place
from HF's strided projections."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@cache
def _kernel():
    return bind("kv_write", "elastic_paged_kv_write",
                [_ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _int, _ptr, _i64, _i64, _ptr, _i64, _i64, _int], _int)


def kv_write_entry():
    """The bound C entry `write_kv_rows` calls (byte strides), for callers that computed every argument themselves
    (layers/lean_decode.py)."""
    return _kernel()


def native_kv_write_available(device: torch.device) -> bool:
    return device.type == "cpu" and _kernel() is not None


def write_kv_rows(rows: torch.Tensor, write_k_rows: torch.Tensor, layer_offset: int, v_offset: int,
                  key: torch.Tensor, value: torch.Tensor) -> None:
    """rows: [arena rows, head_dim], contiguous (KVPagePool.rows); write_k_rows: [T * kv_heads] int64, contiguous,
    distinct, the K row of each (token, kv head) of layer 0 (< 0: skipped); key, value: [1, kv_heads, T, head_dim]
    in the arena's dtype (HF's projections, any strides). K goes to write_k_rows + layer_offset, V v_offset rows
    after its K. Nothing is written when a row falls outside the arena."""
    _, num_kv_heads, num_tokens, head_dim = key.shape
    if key.dtype != rows.dtype or value.dtype != rows.dtype:
        raise ValueError(f"key ({key.dtype}) and value ({value.dtype}) must have the arena's dtype {rows.dtype}")
    if value.shape != key.shape or not rows.is_contiguous() or rows.shape[1] != head_dim:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match, and the arena rows "
                         f"{tuple(rows.shape)} be contiguous and head_dim ({head_dim}) wide")
    if (write_k_rows.numel() != num_tokens * num_kv_heads or write_k_rows.dtype != torch.int64
            or not write_k_rows.is_contiguous()):
        raise ValueError(f"{write_k_rows.numel()} {write_k_rows.dtype} row ids for {num_tokens} tokens x "
                         f"{num_kv_heads} kv heads (contiguous int64 wanted)")
    key = key if key.stride(3) == 1 else key.contiguous()          # the kernel copies whole head_dim rows
    value = value if value.stride(3) == 1 else value.contiguous()
    elem = rows.element_size()
    status = _kernel()(rows.data_ptr(), head_dim * elem, rows.shape[0], write_k_rows.data_ptr(), write_k_rows.numel(),
                       layer_offset, v_offset, num_kv_heads, key.data_ptr(), key.stride(2) * elem,
                       key.stride(1) * elem, value.data_ptr(), value.stride(2) * elem, value.stride(1) * elem,
                       torch.get_num_threads())
    check_kv_write_status(status, write_k_rows, layer_offset, v_offset, rows.shape[0])


def check_kv_write_status(status: int, write_k_rows: torch.Tensor, layer_offset: int, v_offset: int,
                          num_arena_rows: int) -> None:
    """Raise for a non-zero status of the C entry (`kv_write_entry`): a row outside the arena."""
    if status != 0:
        raise ValueError(f"a K/V row id plus layer offset {layer_offset} and V offset {v_offset} falls outside the "
                         f"arena's {num_arena_rows} rows (largest id {int(write_k_rows.max())})")
