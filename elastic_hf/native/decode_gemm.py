"""ctypes binding of decode_gemm.c: a linear's product read straight from the weight oneDNN packed for it
(layers/packed_linear.py); on the AVX-512 Xeon measured, faster than oneDNN's own inner product at 1-512 rows in bf16
and at 1-112 rows in fp32, behind it from 128 fp32 rows, where packed linears route to oneDNN
(layers/packed_linear.py ONEDNN_FP32_FROM_ROWS; benchmarks/decode_gemm.py, benchmarks/RESULTS.md). On an AVX2-only
CPU it is built with ymm tiles; oneDNN packs no bf16 there, so bf16 weights are packed in place (`packed_layout`),
and its fp32 blocking is the kernel's layout for some shapes only (checked per shape, as everywhere). bf16 runs on
widened fp32 FMAs or on vdpbf16ps, whichever a probe at first use finds faster on this CPU (`bf16_dot_chosen`); on
vdpbf16ps (AMD Zen 4: 1.2-1.5x oneDNN at 8-32 rows) bf16 products from 128 rows go to oneDNN
(ONEDNN_BF16_DOT_FROM_ROWS)."""
from __future__ import annotations

import ctypes
import os
import statistics
import time
from functools import cache

import torch

from elastic_hf.native.build import bind, load_library

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_SIGNATURE = [_ptr, _i64, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _int]
_ENTRY_POINTS = {torch.float32: "elastic_decode_gemm_f32", torch.bfloat16: "elastic_decode_gemm_bf16"}
# the packed layout the kernel reads, as oneDNN's reorder writes it for an [N, K] weight (decode_gemm.c): outputs in
# blocks of 64, K in tiles of 16 (fp32) or 16 k-pairs (bf16)
_BLOCK_N = 64
_K_TILE = {torch.float32: 16, torch.bfloat16: 32}

ENV_VAR = "ELASTIC_HF_DECODE_GEMM"
BF16_DOT_ENV_VAR = "ELASTIC_HF_BF16_DOT"
_BF16_DOT_ENTRY_POINT = "elastic_decode_gemm_bf16_dot"
# bf16_dot_chosen's probe: 16 rows x a [512, 1024] weight (1 MiB, in L2), 5 alternating rounds of 4 calls each;
# vdpbf16ps is taken only where it is at least 10 % faster
_PROBE_ROWS, _PROBE_N, _PROBE_K = 16, 512, 1024
_PROBE_ROUNDS, _PROBE_CALLS, _PROBE_MARGIN = 5, 4, 1.1


def decode_gemm_enabled() -> bool:
    """On unless ELASTIC_HF_DECODE_GEMM=0 (then packed linears run oneDNN's inner product: an A/B switch for
    benchmarks/decode_gemm.py and vs_vllm.py), read when a weight is packed."""
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


@cache
def _kernel(dtype: torch.dtype):
    if dtype not in _ENTRY_POINTS:
        return None
    lib = load_library("decode_gemm")
    if lib is None:
        return None
    has = bind("decode_gemm", "elastic_decode_gemm_has", [_int], _int)
    if not has(int(dtype == torch.bfloat16)):
        return None          # compiled for a CPU with neither AVX-512 nor AVX2 + FMA
    if dtype == torch.bfloat16 and bf16_dot_chosen():
        return bind("decode_gemm", _BF16_DOT_ENTRY_POINT, _SIGNATURE, _int)
    return bind("decode_gemm", _ENTRY_POINTS[dtype], _SIGNATURE, _int)


def gemm_entry(dtype: torch.dtype):
    """The bound C entry `decode_gemm` calls for `dtype` (None without one): (x, ldx, weight, bias, y, ldy, m, n, k,
    threads) -> status. For callers that computed every argument themselves (layers/lean_decode.py)."""
    return _kernel(dtype)


def _bf16_dot_setting() -> str:
    setting = os.environ.get(BF16_DOT_ENV_VAR, "auto").strip().lower()
    if setting not in ("auto", "0", "1"):
        raise ValueError(f"{BF16_DOT_ENV_VAR}={setting!r} is not one of auto, 0, 1")
    return setting


@cache
def bf16_dot_chosen() -> bool:
    """Whether bf16 products run on vdpbf16ps (decode_gemm.c tile_bf16_dot) rather than widened fp32 FMAs. The two
    give the same bits (but for denormals, which vdpbf16ps flushes), so the faster one is taken: on AMD Zen 4
    vdpbf16ps issues at an FMA's rate and does twice the multiply-adds (default model's linears at 32 rows 1.7x), on
    the Xeon measured in session 45 at half of it. Measured here once a process, on a product that fits in L2 (the
    arithmetic rate decides; both stream a weight from DRAM alike), unless ELASTIC_HF_BF16_DOT=0|1 says. The choice
    also sends bf16 prefills to oneDNN (layers/packed_linear.py ONEDNN_BF16_DOT_FROM_ROWS), whose sums are ordered
    otherwise: the 10 % margin keeps the CPUs measured (1.6-1.8x, or at most level) from choosing differently in two
    processes; a CPU at the margin should pin it with the variable."""
    setting = _bf16_dot_setting()
    if setting == "0" or load_library("decode_gemm") is None:
        return False
    dot = bind("decode_gemm", _BF16_DOT_ENTRY_POINT, _SIGNATURE, _int)
    probe_x = torch.randn(_PROBE_ROWS, _PROBE_K).to(torch.bfloat16)                     # [M, K]
    probe_w = packed_layout(torch.randn(_PROBE_N, _PROBE_K).to(torch.bfloat16)).contiguous()
    out = torch.empty(_PROBE_ROWS, _PROBE_N, dtype=torch.bfloat16)                       # [M, N]
    args = (probe_x.data_ptr(), _PROBE_K, probe_w.data_ptr(), None, out.data_ptr(), _PROBE_N, _PROBE_ROWS,
            _PROBE_N, _PROBE_K, torch.get_num_threads())
    if dot(*args) != 0:
        return False         # built without AVX512-BF16
    if setting == "1":
        return True
    widened = bind("decode_gemm", _ENTRY_POINTS[torch.bfloat16], _SIGNATURE, _int)
    times: dict[str, list[float]] = {"dot": [], "widened": []}
    for _ in range(_PROBE_ROUNDS):       # alternating, so a neighbour's burst falls on both
        for name, fn in (("dot", dot), ("widened", widened)):
            start = time.perf_counter()
            for _ in range(_PROBE_CALLS):
                fn(*args)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["dot"]) * _PROBE_MARGIN < statistics.median(times["widened"])


def decode_gemm_available(dtype: torch.dtype) -> bool:
    """A kernel for `dtype` on this CPU (AVX-512, or AVX2 + FMA) with native kernels and this one on."""
    return decode_gemm_enabled() and _kernel(dtype) is not None


def packed_layout(weight: torch.Tensor) -> torch.Tensor:
    """The plain [N, K] weight permuted into the layout the kernel reads, flat:
    fp32 [N/64][K/16][16 k][64 n], bf16 [N/64][K/32][16 k-pairs][64 n][2 k] (oneDNN's AB16b64a / AB16b64a2b)."""
    n, k = weight.shape
    tiles = k // _K_TILE[weight.dtype]
    if weight.dtype == torch.bfloat16:
        return weight.view(n // _BLOCK_N, _BLOCK_N, tiles, 16, 2).permute(0, 2, 3, 1, 4).reshape(-1)
    return weight.view(n // _BLOCK_N, _BLOCK_N, tiles, 16).permute(0, 2, 3, 1).reshape(-1)


def _packed_blocks(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The flat packed bytes of an [N, K] weight as packed_layout's blocks: fp32 [N/64][K/16][16][64], bf16
    [N/64][K/32][16][64][2] (a view)."""
    tiles = in_features // _K_TILE[packed.dtype]
    pair = (2,) if packed.dtype == torch.bfloat16 else ()
    return packed.view(out_features // _BLOCK_N, tiles, 16, _BLOCK_N, *pair)


def plain_layout(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The inverse of `packed_layout`: the flat packed bytes of an [N, K] weight as a new, contiguous plain [N, K]
    tensor (reshape alone may return a strided view of the packed bytes: one 64-row block)."""
    blocks = _packed_blocks(packed, out_features, in_features)
    order = (0, 3, 1, 2, 4) if packed.dtype == torch.bfloat16 else (0, 3, 1, 2)   # [N/64][64][K/tile][tile...]
    return blocks.permute(order).contiguous().view(out_features, in_features)


def packed_rows(packed: torch.Tensor, out_features: int, in_features: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` (any shape of indices) of an [N, K] weight held in `packed_layout`, read out of the packed bytes:
    [...] -> [..., K] (an embedding lookup on a table packed for the LM head)."""
    blocks = _packed_blocks(packed, out_features, in_features)
    picked = blocks[rows // _BLOCK_N, :, :, rows % _BLOCK_N]         # [..., K/tile, 16(, 2)]
    return picked.reshape(*rows.shape, in_features)


def _packed_bytes(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over an opaque oneDNN tensor's own buffer (no copy), as `dtype` elements."""
    nbytes = int(torch.ops.mkldnn._nbytes(packed))
    buffer = (ctypes.c_char * nbytes).from_address(packed_data_ptr(packed))
    return torch.frombuffer(buffer, dtype=dtype)


def reads_layout(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether the kernel reads `packed_layout` of an [out, in] `dtype` weight: on and built for the dtype, and the
    shape in whole 64-output blocks and K tiles (it never reads padding). What packing a weight in place needs."""
    return (decode_gemm_available(dtype) and out_features % _BLOCK_N == 0
            and in_features % _K_TILE[dtype] == 0)


def reads_packed(out_features: int, in_features: int, dtype: torch.dtype, batch_hint: int) -> bool:
    """Whether the kernel can read oneDNN's own packing of an [out, in] `dtype` weight: `reads_layout`, and, checked
    on a random probe of that shape (oneDNN picks a layout per shape, dtype, batch hint and CPU: on an AVX2-only CPU
    its fp32 blocking is another one for some shapes, and it packs no bf16 at all), the bytes oneDNN writes equal to
    `packed_layout`."""
    return reads_layout(out_features, in_features, dtype) and _layout_matches(out_features, in_features, dtype,
                                                                              batch_hint)


@cache
def _layout_matches(out_features: int, in_features: int, dtype: torch.dtype, batch_hint: int) -> bool:
    probe = torch.randn(out_features, in_features).to(dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(probe, batch_hint)
    except RuntimeError:   # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        return False
    if int(torch.ops.mkldnn._nbytes(packed)) != probe.numel() * probe.element_size():
        return False
    return torch.equal(_packed_bytes(packed, dtype), packed_layout(probe))


def packed_data_ptr(packed: torch.Tensor) -> int:
    """Address of an opaque oneDNN tensor's buffer (stable while the tensor lives)."""
    return int(torch.ops.mkldnn.data_ptr(packed))


def decode_gemm(x: torch.Tensor, weight_ptr: int, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x @ W.T (+ bias) for the packed weight at `weight_ptr` ([out_features, K] as `reads_packed` accepted it):
    x [..., K] in the weight's dtype -> [..., out_features]; bias [out_features] contiguous in that dtype. The caller
    checked dtype, device, bias and `reads_packed` once; this runs for every linear of every step (~5 us of Python
    and ctypes a call), so it checks only what the kernel cannot survive."""
    k = x.shape[-1]
    if x.is_contiguous():
        rows, row_stride = x, k                               # [..., K] read as [M, K]: no reshape op
    else:
        rows = x.reshape(-1, k)                               # [M, K]; a copy only where x's rows are not uniform
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        row_stride = rows.stride(0)
    out = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    num_rows = out.numel() // out_features if out_features else 0
    if num_rows == 0:
        return out
    status = _kernel(x.dtype)(rows.data_ptr(), row_stride, weight_ptr, None if bias is None else bias.data_ptr(),
                              out.data_ptr(), out_features, num_rows, out_features, k, torch.get_num_threads())
    check_gemm_status(status, num_rows, k, out_features)
    return out


def check_gemm_status(status: int, num_rows: int, k: int, out_features: int) -> None:
    """Raise for a non-zero status of the C entry (`gemm_entry`) on a [num_rows, k] x [out_features, k] product."""
    if status == -2:
        raise MemoryError(f"decode_gemm could not allocate its scratch: {64 * 128 * 4} bytes of partial sums a "
                          f"thread, and for bf16 on fp32 FMAs {min(num_rows, 128) * k * 4} bytes of widened input")
    if status != 0:
        raise ValueError(f"decode_gemm takes no [{num_rows}, {k}] x [{out_features}, {k}] product")
