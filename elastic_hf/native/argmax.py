"""ctypes binding of argmax.c: greedy decoding's row argmax over fp32 logits, torch's semantics (first maximum,
NaN counts as the maximum)."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@cache
def _kernel():
    return bind("argmax", "elastic_argmax_rows_f32", [_ptr, _i64, _i64, _i64, _ptr, _int])


def native_argmax_available() -> bool:
    """Compiles (once per machine) or loads the kernel; the instance build calls it so that this happens before the
    first request's step, not inside it."""
    return _kernel() is not None


def argmax_rows(logits: torch.Tensor) -> list[int]:
    """The argmax of every row of `logits` [rows, vocab], as torch's `logits.max(dim=-1).indices.tolist()` gives
    it; the native kernel for contiguous-row fp32 CPU tensors, torch otherwise."""
    kernel = _kernel()
    if (kernel is None or logits.dtype != torch.float32 or logits.device.type != "cpu" or logits.dim() != 2
            or logits.stride(1) != 1 or logits.shape[1] == 0):
        return logits.max(dim=-1).indices.tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    kernel(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1], out.data_ptr(),
           torch.get_num_threads())
    return out.tolist()
