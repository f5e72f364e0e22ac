"""ctypes binding of lean_layer.c: one decode-only layer as one C call over the other kernels' own entries
(layers/lean_decode.py builds the structures). The structures mirror the C ones field for field."""
from __future__ import annotations

import ctypes
from functools import cache

from elastic_hf.native.build import bind

_i64, _int, _float, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p

# lean_layer.c's LEAN_OP_*: which kernel a failing call stopped at
OP_NORM, OP_GEMM, OP_ROTARY, OP_KV_WRITE, OP_ATTEND, OP_SILU, OP_RESIDUAL = 1, 2, 3, 4, 5, 6, 7
OP_NAMES = {OP_NORM: "RMSNorm", OP_GEMM: "decode GEMM", OP_ROTARY: "rotary", OP_KV_WRITE: "K/V write",
            OP_ATTEND: "paged decode attention", OP_SILU: "silu * up", OP_RESIDUAL: "residual add"}
# LeanStep.op_seconds: seconds per op kind, indexed by OP_* (0 unused)
OpSeconds = ctypes.c_double * 8


class LeanStep(ctypes.Structure):
    _fields_ = [("norm", _ptr), ("gemm", _ptr), ("silu", _ptr), ("rotary", _ptr), ("kv_write", _ptr),
                ("attend", _ptr), ("elem", _i64), ("tokens", _i64), ("threads", _i64), ("cos", _ptr), ("sin", _ptr),
                ("cs_tok_stride", _i64), ("arena_rows", _ptr), ("arena_row_count", _i64), ("write_rows", _ptr),
                ("chunks", _ptr), ("chunk_ids", _ptr), ("chunk_id_count", _i64), ("lens", _ptr), ("block_size", _i64),
                ("rows_per_layer", _i64), ("chunks_per_layer", _i64),
                ("h", _ptr), ("qkv", _ptr), ("q", _ptr), ("k", _ptr), ("att", _ptr), ("o", _ptr), ("gate_up", _ptr),
                ("act", _ptr), ("down", _ptr), ("op_seconds", _ptr)]


# LeanStep's workspace buffers, in the order of a plan's widths (layers/lean_decode.py)
WORKSPACE = ("h", "qkv", "q", "k", "att", "o", "gate_up", "act", "down")


class LeanProduct(ctypes.Structure):
    _fields_ = [("weight", _ptr), ("bias", _ptr), ("n", _i64), ("column", _i64)]


class LeanLayer(ctypes.Structure):
    _fields_ = [("norm1", _ptr), ("norm2", _ptr), ("eps1", _float), ("eps2", _float), ("scaling", _float),
                ("hidden", _i64), ("q_size", _i64), ("kv_size", _i64), ("head_dim", _i64), ("inter", _i64),
                ("n_qkv", _i64), ("n_gate_up", _i64), ("qkv", LeanProduct * 3), ("o", LeanProduct),
                ("gate_up", LeanProduct * 2), ("down", LeanProduct)]


@cache
def lean_layer_entries():
    """(elastic_lean_layer, elastic_lean_mlp_down, elastic_lean_layers), or None where native kernels are off or
    cannot be built."""
    # structures by address (ctypes.addressof, taken once): an int converts faster than a byref a call
    layer = bind("lean_layer", "elastic_lean_layer", [_ptr, _ptr, _i64, _ptr, _ptr, _int, _ptr], _int)
    down = bind("lean_layer", "elastic_lean_mlp_down", [_ptr, _ptr, _ptr, _ptr, _ptr], _int)
    run = bind("lean_layer", "elastic_lean_layers", [_ptr, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr], _int)
    return None if layer is None or down is None or run is None else (layer, down, run)


def entry_address(fn) -> int:
    """The C address of a bound ctypes function (what LeanStep's kernel fields hold)."""
    return ctypes.cast(fn, ctypes.c_void_p).value
