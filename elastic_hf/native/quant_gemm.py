"""ctypes binding of quant_gemm.c: W8 and W4 weight-only products read from the blocked layouts that
layers/w8_linear.py and layers/w4_linear.py keep on the CPU, fp32 or bf16 activations, any number of rows
(benchmarks/quant_kernels.py measures them against aten's int-pack kernels and the fp32 dense product)."""
from __future__ import annotations

import ctypes
import os
from functools import cache

import torch

from elastic_hf.native.build import bind

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURE = [_ptr, _i64, _int, _ptr, _int, _ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _int]
BLOCK_N = 64    # outputs a block (W8: one 64-byte line per k; W4: 32 bytes)
K_TILE = 16     # k a tile

ENV_VAR = "ELASTIC_HF_QUANT_GEMM"


def quant_gemm_enabled() -> bool:
    """On unless ELASTIC_HF_QUANT_GEMM=0 (then W8 / W4 layers keep aten's int-pack kernels and layouts: an A/B
    switch for benchmarks/quant_kernels.py), read when a layer is built."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


@cache
def _kernel():
    has = bind("quant_gemm", "elastic_quant_gemm_has", [], _int)
    if has is None or not has():
        return None          # native kernels off, no compiler, or a CPU with neither AVX-512 nor AVX2 + FMA
    return bind("quant_gemm", "elastic_quant_gemm", _SIGNATURE, _int)


def quant_gemm_supports(out_features: int, in_features: int, device: torch.device | str | None,
                        group_size: int | None = None) -> bool:
    """Whether a W8 (group_size None) or W4 layer of this shape on `device` runs on this kernel: the CPU, the
    kernel on and built here, whole 64-output blocks, 16-wide K tiles, W4 groups of whole tiles."""
    if torch.device(device or "cpu").type != "cpu" or out_features % BLOCK_N or in_features % K_TILE:
        return False
    if group_size is not None and (group_size % K_TILE or in_features % group_size):
        return False
    return quant_gemm_enabled() and _kernel() is not None


def w8_to_blocked(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernel's W8 layout [N/64, K/16, 16 k, 64 n]."""
    n, k = q.shape
    return q.reshape(n // BLOCK_N, BLOCK_N, k // K_TILE, K_TILE).permute(0, 2, 3, 1).contiguous()


def w8_from_blocked(blocked: torch.Tensor) -> torch.Tensor:
    """Inverse of `w8_to_blocked`: [N/64, K/16, 16, 64] -> int8 [N, K]."""
    nb, kt, _, _ = blocked.shape
    return blocked.permute(0, 3, 1, 2).reshape(nb * BLOCK_N, kt * K_TILE)


def w4_to_blocked(q: torch.Tensor) -> torch.Tensor:
    """q in [0, 15] [N, K] (any integer dtype) -> the kernel's W4 layout uint8 [N/64, K/16, 16 k, 32]: byte i of
    a k-row holds output i in its low nibble and output 32 + i in its high one."""
    n, k = q.shape
    rows = q.to(torch.uint8).reshape(n // BLOCK_N, BLOCK_N, k // K_TILE, K_TILE).permute(0, 2, 3, 1)  # [.., 64 n]
    return (rows[..., :32] | (rows[..., 32:] << 4)).contiguous()


def w4_from_blocked(blocked: torch.Tensor) -> torch.Tensor:
    """Inverse of `w4_to_blocked`: uint8 [N/64, K/16, 16, 32] -> q int32 [N, K]."""
    nb, kt, _, _ = blocked.shape
    rows = torch.cat([blocked & 15, blocked >> 4], dim=-1)                       # [N/64, K/16, 16 k, 64 n]
    return rows.permute(0, 3, 1, 2).reshape(nb * BLOCK_N, kt * K_TILE).to(torch.int32)


def quant_gemm(x: torch.Tensor, blocked: torch.Tensor, bias: torch.Tensor | None, *, scales: torch.Tensor | None = None,
               scales_and_zeros: torch.Tensor | None = None, group_size: int | None = None) -> torch.Tensor:
    """x [..., K] fp32 or bf16 @ W^T + bias -> [..., N] in x's dtype. W8: `blocked` int8 [N/64, K/16, 16, 64] and
    `scales` [N]; W4: `blocked` uint8 [N/64, K/16, 16, 32], `scales_and_zeros` [K/g, N, 2] and `group_size`. Scales,
    zeros and bias fp32 and contiguous (the layers keep them so)."""
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"quant_gemm takes fp32 or bf16 activations, got {x.dtype}")
    bits = 8 if scales is not None else 4
    n, k = blocked.shape[0] * BLOCK_N, blocked.shape[1] * K_TILE
    if x.shape[-1] != k:
        raise ValueError(f"quant_gemm: x has {x.shape[-1]} features, the weight {k}")
    rows = x.reshape(-1, k)                                   # [M, K]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype)      # [..., N]
    num_rows = rows.shape[0]
    if num_rows == 0:
        return out
    status = _kernel()(rows.data_ptr(), rows.stride(0), int(x.dtype == torch.bfloat16), blocked.data_ptr(), bits,
                       None if scales is None else scales.data_ptr(),
                       None if scales_and_zeros is None else scales_and_zeros.data_ptr(), group_size or 0,
                       None if bias is None else bias.data_ptr(), out.data_ptr(), n, num_rows, n, k,
                       torch.get_num_threads())
    if status == -2:
        raise MemoryError(f"quant_gemm could not allocate its scratch ({min(num_rows, 256) * k * 4} bytes of widened "
                          f"bf16 input, 80 KiB a thread)")
    if status != 0:
        raise ValueError(f"quant_gemm takes no W{bits} [{num_rows}, {k}] x [{n}, {k}] product")
    return out
