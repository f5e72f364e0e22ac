"""ctypes binding of fused_elementwise.c: RMSNorm and SwiGLU's silu(gate) * up in one pass over the rows, fp32 and
bf16, on the CPU."""
from __future__ import annotations

import ctypes
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@cache
def _kernels() -> dict | None:
    kernels = {dtype: (bind("fused_elementwise", f"elastic_rms_norm_{suffix}",
                            [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _float, _int], _int),
                       bind("fused_elementwise", f"elastic_silu_mul_{suffix}",
                            [_ptr, _i64, _ptr, _i64, _i64, _i64, _int], _int))
               for dtype, suffix in _SUFFIX.items()}
    return None if any(None in pair for pair in kernels.values()) else kernels


def elementwise_entries(dtype: torch.dtype):
    """The bound C entries (rms_norm, silu_mul) `rms_norm` and `silu_and_mul` call, for callers that computed every
    argument themselves (layers/lean_decode.py)."""
    return _kernels()[dtype]


def native_elementwise_available(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _SUFFIX and _kernels() is not None


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with the last dim contiguous and rows at one stride (a view where possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm of x [..., dim] with weight [dim] of x's dtype; returns a new tensor of x's shape."""
    norm, _ = _kernels()[x.dtype]
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{x.shape[-1]}] {x.dtype} tensor, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    rows = rows_2d(x)                                        # [rows, dim]
    out = torch.empty(rows.shape, dtype=x.dtype)
    norm(rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), rows.shape[0],
         rows.shape[1], eps, torch.get_num_threads())
    return out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [..., 2 * inter] = [gate | up]; returns [..., inter]."""
    _, swiglu = _kernels()[gate_up.dtype]
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dim must be 2 x the intermediate size, got {gate_up.shape[-1]}")
    rows = rows_2d(gate_up)                                  # [rows, 2 * inter]
    inter = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype)
    swiglu(rows.data_ptr(), rows.stride(0), out.data_ptr(), out.stride(0), rows.shape[0], inter,
           torch.get_num_threads())
    return out.view(*gate_up.shape[:-1], inter)
