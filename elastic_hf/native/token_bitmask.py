"""ctypes binding of token_bitmask.c: structured output's per-step token mask applied to fp32 logits rows in
place; a torch fallback where native kernels are off."""
from __future__ import annotations

import ctypes
from functools import cache

import numpy as np
import torch

from elastic_hf.native.build import bind

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p


@cache
def _kernel():
    return bind("token_bitmask", "elastic_apply_token_bitmask_f32", [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _int])


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """In place: logits [R, V]; bitmask int32 [len(rows), W], row k the allowed tokens of logits row rows[k] (bit i of
    word w: token 32 w + i). Disallowed tokens, and any column beyond 32 W, become -inf."""
    bitmask = bitmask.contiguous()
    index = torch.tensor(rows, dtype=torch.int64)
    kernel = _kernel()
    if kernel is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" \
            and logits.stride(1) == 1:
        kernel(logits.data_ptr(), logits.stride(0), logits.shape[1], index.data_ptr(), len(rows),
               bitmask.data_ptr(), bitmask.shape[1], torch.get_num_threads())
        return
    # The model's logits are inference tensors (made under torch.inference_mode), which torch lets only code in
    # that mode update in place (on a GPU, where this path runs, the first constrained request failed here).
    with torch.inference_mode():
        # little-endian int32 words as bytes, unpacked low bit first: token order
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")   # [n, 32W]
        allowed = torch.from_numpy(bits).to(torch.bool)
        vocab, width = logits.shape[1], min(logits.shape[1], bits.shape[1])
        sub = logits.index_select(0, index.to(logits.device))                               # [n, V]
        sub[:, :width].masked_fill_(~allowed[:, :width].to(logits.device), float("-inf"))
        sub[:, width:vocab] = float("-inf")
        logits.index_copy_(0, index.to(logits.device), sub)
