"""A decode-only CPU step of a switched Llama-family layer (layers/fused_decoder_layer.py) as one C call
(native/lean_layer.c) that runs the native kernels in turn, with every argument computed once: the layer's constants
once per layer (a plan, rebuilt when a part of the layer changes), the step's addresses once per step.

The fused layer forward spends ~230 us of Python a layer on a 2-core EPYC (30 layers: ~7 ms a step, a quarter of a
batch-1 bf16 step of the default model): six module calls, and nine kernel wrappers that each validate their inputs,
allocate their output (`torch.empty`, ~3 us), build views and strides. Calling the kernels straight from Python
still took ~80 us a layer (a dozen foreign calls of 10-20 converted arguments, buffer lookups, two torch adds: ~2.4 ms
of the same step); one C call takes ~15 us with its plan check. The kernels are the same on the same bytes in the same
order: RMSNorm -> the fused q/k/v product -> rotary -> the K/V write -> paged decode attention -> o -> residual add
-> RMSNorm -> the fused gate/up product -> silu * up -> down -> residual add, so the outputs are bit-identical to the
fused forward's (and so HF's: tests/layers/test_lean_decode.py). What the layer leaves between kernels lives in one
workspace a step shares across its layers (they run one after another); the residual stream is a fresh tensor per
layer, as HF's is.

It runs only where every part is the kind it knows: native RMSNorms; q/k/v and gate/up as one packed product each,
or (a morphing instance packs every linear alone, so that each layer can swap precision) as packed linears written
side by side into one buffer, with HF's MLP formula (act_fn(gate) * up in torch, between two C calls) where the MLP
is HF's; o/down packed; all read by native/decode_gemm.c below their oneDNN row threshold; the native rotary; the C
attention backend over a KV arena of the activations' dtype; a step whose every row is one decode of a uniformly
attending model. Anything else returns None and the fused forward runs: a prefill in the step, a morphed (quantized)
layer, sharded linears, soft-capping, a decode past a sliding window. ELASTIC_HF_LEAN_DECODE=0 turns it off (A/B)."""
from __future__ import annotations

import ctypes
import os
import weakref
from functools import cache

import torch
from torch import nn

from elastic_hf.layers.native_norm import NativeRMSNorm
from elastic_hf.layers.packed_linear import FusedMemberLinear, PackedLinear
from elastic_hf.layers.swiglu_mlp import SwiGLUMLP
from elastic_hf.native.decode_gemm import check_gemm_status, gemm_entry
from elastic_hf.native.fused_elementwise import elementwise_entries, native_elementwise_available
from elastic_hf.native.kv_write import check_kv_write_status, kv_write_entry, native_kv_write_available
from elastic_hf.native.lean_layer import (OP_ATTEND, OP_GEMM, OP_KV_WRITE, OP_NAMES, WORKSPACE, LeanLayer, LeanStep,
                                          OpSeconds, entry_address, lean_layer_entries)
from elastic_hf.native.paged_decode import check_decode_status, decode_entry
from elastic_hf.native.rotary import native_rotary_available, rotary_entry

LEAN_DECODE_ENV_VAR = "ELASTIC_HF_LEAN_DECODE"
NATIVE_ATTENTION_BACKEND = "cpu_native"   # kv/attention_backends.py CpuNativeAttention.name


@cache
def lean_decode_enabled() -> bool:
    """Read once a process (tests clear the cache)."""
    setting = os.environ.get(LEAN_DECODE_ENV_VAR, "1").strip()
    if setting not in ("0", "1"):
        raise ValueError(f"{LEAN_DECODE_ENV_VAR}={setting!r} is not 0 or 1")
    return setting == "1"


# Seconds the C layer spends in each kernel kind, while a profiler asks for them (time_kernels); None: not timed
_kernel_seconds: OpSeconds | None = None


def time_kernels(on: bool) -> OpSeconds | None:
    """From the next step on, add the seconds of every kernel the C layer calls to a fresh array indexed by
    native/lean_layer.py's OP_* (returned), or stop (None). A profiler's view inside the one foreign call, where no
    torch op marks a kernel (benchmarks/step_profile.py)."""
    global _kernel_seconds
    _kernel_seconds = OpSeconds() if on else None
    return _kernel_seconds


# ------------------------------------------------------------------------------------------------ the layer's plan
class _LayerPlan:
    """A layer's LeanLayer, valid while `key` (the identities of its parts and the addresses read) is the layer's."""

    __slots__ = ("key", "struct", "address", "native_silu", "max_tokens", "head_dim", "inter", "widths", "act_fn",
                 "keep")


# layer -> its plan (weakly: a retired instance's layers go with it; a plan holds raw addresses, so it is never
# copied with a layer). Through its key a plan holds the modules and packed products it read until the layer's next
# decode step finds them changed: what a layer drops between two steps lives one step longer (the memory reshapes,
# drops and morphs give back is arena pages, which no reference keeps).
_plans: weakref.WeakKeyDictionary[nn.Module, _LayerPlan] = weakref.WeakKeyDictionary()


def _plan_key(layer, dtype: torch.dtype) -> tuple:
    """What the plan was built from: the modules, the packed products they read (a repack makes a new one) and the
    norms' addresses. Read from the modules' own dicts: nn.Module's attribute fallback costs ~0.6 us a name, 13 us a
    layer here, against ~4 us so (the ~60 us of checks and conversions the plan saves are the point)."""
    modules = layer._modules
    attn, mlp = modules["self_attn"]._modules, modules["mlp"]
    mlp_modules = mlp._modules
    parts = (attn.get("q_proj"), attn.get("k_proj"), attn.get("v_proj"), attn.get("o_proj"),
             mlp_modules.get("gate_proj"), mlp_modules.get("up_proj"), mlp_modules.get("down_proj"))
    norm1, norm2 = modules["input_layernorm"], modules["post_attention_layernorm"]
    return (dtype, mlp, norm1, norm2, norm1._parameters["weight"].data_ptr(), norm2._parameters["weight"].data_ptr(),
            *parts, *map(_direct_of, parts))


def _direct_of(module):
    """The DirectProduct a linear reads (a fused member: its group's), or None."""
    if module is None:
        return None
    fused = module.__dict__.get("fused")
    return module.__dict__.get("direct") if fused is None else getattr(fused, "direct", None)


def _plan(layer, dtype: torch.dtype) -> _LayerPlan:
    key = _plan_key(layer, dtype)
    plan = _plans.get(layer)
    if plan is None or plan.key != key:
        plan = _plans[layer] = _build_plan(layer, dtype, key)
    return plan


def _packed(module, dtype: torch.dtype):
    """The DirectProduct of a packed linear the native kernel reads in `dtype`, else None."""
    direct = getattr(module, "direct", None)
    return direct if direct is not None and direct.dtype == dtype else None


# HF MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)): a morphing instance keeps them
HF_SWIGLU_MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "MistralMLP")


def _projections(attn, dtype: torch.dtype) -> list | None:
    """q/k/v as [(DirectProduct, bias, first output column)]: one fused product, or three packed linears (a morphing
    instance packs each alone) written side by side into one [T, q | k | v] buffer; None where one is neither."""
    q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
    if type(q_proj) is FusedMemberLinear:
        qkv = q_proj.fused
        if qkv.num_members != 3 or k_proj.fused is not qkv or v_proj.fused is not qkv or not qkv.packed:
            return None
        parts = [(_packed(qkv, dtype), qkv.bias, 0)]
    elif type(q_proj) is PackedLinear and type(k_proj) is PackedLinear and type(v_proj) is PackedLinear:
        q_size, kv_size = q_proj.out_features, k_proj.out_features
        parts = [(_packed(m, dtype), m.bias, start)
                 for m, start in ((q_proj, 0), (k_proj, q_size), (v_proj, q_size + kv_size))]
    else:
        return None
    return parts if all(direct is not None for direct, _, _ in parts) else None


def _mlp_products(mlp, dtype: torch.dtype) -> tuple[list, bool] | None:
    """gate/up as [(DirectProduct, bias, first output column)] into one [T, gate | up] buffer, and whether silu * up
    runs in the native kernel (SwiGLUMLP) or as HF's act_fn and product (HF's MLP on packed linears)."""
    if type(mlp) is SwiGLUMLP:
        gate_up = mlp.gate_proj.fused
        if gate_up.num_members != 2 or mlp.up_proj.fused is not gate_up or not gate_up.packed:
            return None
        parts, native = [(_packed(gate_up, dtype), gate_up.bias, 0)], True
    elif (type(mlp).__name__ in HF_SWIGLU_MLP_CLASSES and type(mlp).__module__.startswith("transformers.models.")
          and type(mlp.gate_proj) is PackedLinear and type(mlp.up_proj) is PackedLinear):
        parts = [(_packed(mlp.gate_proj, dtype), mlp.gate_proj.bias, 0),
                 (_packed(mlp.up_proj, dtype), mlp.up_proj.bias, mlp.gate_proj.out_features)]
        native = False
    else:
        return None
    return (parts, native) if all(direct is not None for direct, _, _ in parts) else None


def _build_plan(layer, dtype: torch.dtype, key: tuple) -> _LayerPlan:
    """The layer's plan; its `struct` is None where a part is not of the kinds above (kept, so that the check is not
    repeated every step while the layer stays so)."""
    plan = _LayerPlan()
    plan.key, plan.struct = key, None
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    o_proj, down_proj = attn.o_proj, getattr(mlp, "down_proj", None)
    if (type(norm1) is not NativeRMSNorm or type(norm2) is not NativeRMSNorm or norm1.weight.dtype != dtype
            or norm2.weight.dtype != dtype or type(o_proj) is not PackedLinear or type(down_proj) is not PackedLinear
            or lean_layer_entries() is None):
        return plan
    qkv_parts, mlp_parts = _projections(attn, dtype), _mlp_products(mlp, dtype)
    o_w, down_w = _packed(o_proj, dtype), _packed(down_proj, dtype)
    if qkv_parts is None or mlp_parts is None or o_w is None or down_w is None:
        return plan
    gate_up_parts, native_silu = mlp_parts
    head_dim, hidden = attn.head_dim, o_w.out_features
    q_size, kv_size = attn.q_proj.out_features, attn.k_proj.out_features
    inter2 = sum(direct.out_features for direct, _, _ in gate_up_parts)
    inter = inter2 // 2
    if (q_size != o_proj.in_features or down_proj.in_features != inter or down_w.out_features != hidden
            or sum(d.out_features for d, _, _ in qkv_parts) != q_size + 2 * kv_size
            or q_size % head_dim or kv_size % head_dim or norm1.weight.numel() != hidden):
        return plan
    s = LeanLayer()
    s.norm1, s.norm2 = norm1.weight.data_ptr(), norm2.weight.data_ptr()
    s.eps1, s.eps2, s.scaling = norm1.variance_epsilon, norm2.variance_epsilon, attn.scaling
    s.hidden, s.q_size, s.kv_size, s.head_dim, s.inter = hidden, q_size, kv_size, head_dim, inter
    s.n_qkv, s.n_gate_up = len(qkv_parts), len(gate_up_parts)
    products = [*qkv_parts, (o_w, o_proj.bias, 0), *gate_up_parts, (down_w, down_proj.bias, 0)]
    slots = [*s.qkv[:len(qkv_parts)], s.o, *s.gate_up[:len(gate_up_parts)], s.down]
    for slot, (direct, bias, column) in zip(slots, products):
        slot.weight, slot.bias, slot.n, slot.column = direct.weight_ptr, _ptr(bias), direct.out_features, column
    plan.struct, plan.address = s, ctypes.addressof(s)
    plan.native_silu = native_silu
    plan.max_tokens = min(direct.onednn_from_rows for direct, _, _ in products)   # oneDNN runs from there on
    plan.head_dim, plan.inter = head_dim, inter
    plan.widths = (hidden, q_size + 2 * kv_size, q_size, kv_size, q_size, hidden, inter2, inter, hidden)  # WORKSPACE
    plan.act_fn = None if native_silu else mlp.act_fn
    # what the addresses point into: the plan keeps them alive while it lives (the key holds the modules)
    plan.keep = (norm1.weight, norm2.weight, *(bias for _, bias, _ in products))
    return plan


# ------------------------------------------------------------------------------------------------ the step's context
class _StepContext:
    """What every layer of one decode step shares: the LeanStep (kernels, the batch's addresses, the workspace), its
    address, and what that points into. Built by the step's first layer (`_context`)."""

    __slots__ = ("cos", "sin", "tokens", "dtype", "head_dim", "first_layer", "step", "address", "buffers", "widths",
                 "failed", "failed_address", "batch", "timer")

    def fit(self, widths: tuple) -> None:
        """Workspace buffers of at least `widths` elements a row (a layer wider than those before it grows them)."""
        if widths == self.widths:
            return
        for name, width, have in zip(WORKSPACE, widths, self.widths or (0,) * len(WORKSPACE)):
            if width > have:
                buf = self.buffers[name] = torch.empty(self.tokens * width, dtype=self.dtype)
                setattr(self.step, name, buf.data_ptr())
        self.widths = tuple(max(w, h) for w, h in zip(widths, self.widths or widths))


def _context(batch, cos: torch.Tensor, sin: torch.Tensor, tokens: int, dtype: torch.dtype) -> _StepContext | None:
    """The step's context, kept on its batch (PagedBatch.scratch) so that it lives exactly as long as the step; None
    where the step is not a decode-only one of the native backend (remembered as False for its other layers)."""
    ctx = batch.scratch
    if isinstance(ctx, _StepContext) and ctx.cos is cos and ctx.sin is sin:
        return ctx
    if ctx is False:
        return None
    ctx = _build_context(batch, cos, sin, tokens, dtype)
    batch.scratch = False if ctx is None else ctx
    return ctx


def _build_context(batch, cos: torch.Tensor, sin: torch.Tensor, tokens: int, dtype: torch.dtype) -> _StepContext | None:
    d = batch.decodes
    pool = batch.pool
    if (type(batch.backend).name != NATIVE_ATTENTION_BACKEND or batch.prefills or d is None or d.first_row != 0
            or d.num_seqs != tokens or batch.by_layer is not None or batch.softcap is not None
            or pool.rows.dtype != dtype or not pool.rows.is_contiguous() or not pool.chunks.is_contiguous()
            or not native_elementwise_available(dtype, pool.rows.device)
            or not native_rotary_available(dtype, cos.device) or not native_kv_write_available(pool.rows.device)):
        return None
    # cos, sin: [1, T, head_dim] as HF's rotary embedding gives them; the kernel reads them at one token stride
    if (cos.dtype != dtype or sin.dtype != dtype or cos.dim() != 3 or cos.shape[:2] != (1, tokens)
            or cos.stride() != sin.stride() or cos.stride(2) != 1):
        return None
    gemm, attend = gemm_entry(dtype), decode_entry(dtype)
    if gemm is None or attend is None:   # (the C layer itself: the plan had it)
        return None
    norm, silu = elementwise_entries(dtype)
    layout = pool.layout
    s = LeanStep()
    s.norm, s.gemm, s.silu = entry_address(norm), entry_address(gemm), entry_address(silu)
    s.rotary, s.kv_write, s.attend = entry_address(rotary_entry(dtype)), entry_address(kv_write_entry()), \
        entry_address(attend)
    s.elem, s.tokens, s.threads = dtype.itemsize, tokens, torch.get_num_threads()
    s.cos, s.sin, s.cs_tok_stride = cos.data_ptr(), sin.data_ptr(), cos.stride(1)
    s.arena_rows, s.arena_row_count, s.write_rows = pool.rows.data_ptr(), pool.rows.shape[0], \
        batch.write_k_rows.data_ptr()
    s.chunks, s.chunk_ids, s.lens = pool.chunks.data_ptr(), d.chunk_ids.data_ptr(), d.lens.data_ptr()
    s.chunk_id_count = d.chunk_ids.numel()   # [tokens, kv_heads, 2, max_blocks]: C divides by the layer's kv_heads
    s.block_size, s.rows_per_layer, s.chunks_per_layer = layout.block_size, layout.rows_per_layer, \
        layout.chunks_per_layer
    s.op_seconds = None if _kernel_seconds is None else ctypes.addressof(_kernel_seconds)
    ctx = _StepContext()
    ctx.cos, ctx.sin, ctx.tokens, ctx.dtype, ctx.head_dim = cos, sin, tokens, dtype, cos.shape[2]
    ctx.first_layer = layout.first_layer
    ctx.step, ctx.address = s, ctypes.addressof(s)
    ctx.buffers, ctx.widths = {}, None
    ctx.failed = ctypes.c_int(0)
    ctx.failed_address = ctypes.addressof(ctx.failed)
    ctx.batch = batch   # (the chunk table, lengths and write rows the addresses point into live on the batch)
    ctx.timer = _kernel_seconds   # alive while the step adds to it, even if the profiler stops mid-step
    return ctx


# ------------------------------------------------------------------------------------------------ the layer's step
def lean_decode_forward(layer, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        batch) -> torch.Tensor | None:
    """The layer's output for a decode-only step, or None where a part is not of the kinds above (the caller runs the
    fused forward). hidden_states: [1, T, hidden], one decode token per row."""
    dtype = hidden_states.dtype
    plan = _plan(layer, dtype)
    tokens = hidden_states.shape[1]
    if (plan.struct is None or tokens >= plan.max_tokens or not hidden_states.is_contiguous()
            or hidden_states.device.type != "cpu"):
        return None
    ctx = _context(batch, cos, sin, tokens, dtype)
    if ctx is None or ctx.head_dim != plan.head_dim:   # (a partial rotary is not the kernel's formula)
        return None
    ctx.fit(plan.widths)
    layer_entry, down_entry = lean_layer_entries()
    local_layer = layer.self_attn.layer_idx - ctx.first_layer   # a pipeline stage holds only its own layers
    out = torch.empty_like(hidden_states)                        # [1, T, hidden]: the residual stream, a new tensor
    status = layer_entry(ctx.address, plan.address, local_layer, hidden_states.data_ptr(), out.data_ptr(),
                         plan.native_silu, ctx.failed_address)
    if status:
        _raise(ctx, plan, local_layer, status)
    if not plan.native_silu:   # HF's own formula, rounding where it rounds: act_fn(gate) * up
        inter = plan.inter
        gate_up = ctx.buffers["gate_up"][:tokens * 2 * inter].view(tokens, 2 * inter)     # [T, gate | up]
        act = (plan.act_fn(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()         # [T, inter]
        status = down_entry(ctx.address, plan.address, act.data_ptr(), out.data_ptr(), ctx.failed_address)
        if status:
            _raise(ctx, plan, local_layer, status)
    return out


def _raise(ctx: _StepContext, plan: _LayerPlan, local_layer: int, status: int) -> None:
    """The error of the kernel lean_layer.c stopped at, with the numbers its own wrapper gives."""
    op, s, layer = ctx.failed.value, ctx.step, plan.struct
    kv_heads = layer.kv_size // layer.head_dim
    if op == OP_KV_WRITE:
        check_kv_write_status(status, ctx.batch.write_k_rows, local_layer * s.rows_per_layer, s.block_size,
                              s.arena_row_count)
    if op == OP_ATTEND:
        check_decode_status(status, layer.head_dim, s.chunk_id_count // (ctx.tokens * kv_heads * 2), s.block_size)
    if op == OP_GEMM:
        check_gemm_status(status, ctx.tokens, layer.hidden, layer.q_size + 2 * layer.kv_size)
    raise RuntimeError(f"{OP_NAMES.get(op, f'kernel {op}')} failed with status {status} in layer {local_layer} of a "
                       f"{ctx.tokens}-row decode step")


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
