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
workspace a step shares across its layers (they run one after another).

Runs of layers: where the batch knows the decoder's layer order (PagedBatch.layer_order), a layer of native silu
computes itself and the lean layers of native silu right after it in one call (`elastic_lean_layers`): between two
layer calls Python still spent ~50-80 us a layer in a real step, with the interpreter's code and data cold after
each layer's weight stream. HF's loop then calls the others and they pass the run's output through
(`_pass_through`, which checks the order); model/flat_forward.py does not call them (`take_lean_run`).

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
from functools import cache

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from elastic_hf.layers.lean_plan import LayerPlan, layer_plan
from elastic_hf.native.decode_gemm import check_gemm_status, gemm_entry
from elastic_hf.native.fused_elementwise import elementwise_entries, native_elementwise_available
from elastic_hf.native.kv_write import check_kv_write_status, kv_write_entry, native_kv_write_available
from elastic_hf.native.lean_layer import (OP_ATTEND, OP_GEMM, OP_KV_WRITE, OP_NAMES, WORKSPACE, LeanStep, OpSeconds,
                                          entry_address, lean_layer_entries)
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


# ------------------------------------------------------------------------------------------------ the step's context
class _StepContext:
    """What every layer of one decode step shares: the LeanStep (kernels, the batch's addresses, the workspace), its
    address, and what that points into. Built by the step's first layer (`_context`)."""

    __slots__ = ("cos", "sin", "tokens", "dtype", "head_dim", "first_layer", "step", "address", "buffers", "widths",
                 "failed", "failed_address", "failed_index", "failed_index_address", "batch", "timer", "run_out",
                 "run_rest")

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
    ctx.failed_index = ctypes.c_int64(0)
    ctx.failed_index_address = ctypes.addressof(ctx.failed_index)
    ctx.run_out, ctx.run_rest = None, []
    ctx.batch = batch   # (the chunk table, lengths and write rows the addresses point into live on the batch)
    ctx.timer = _kernel_seconds   # alive while the step adds to it, even if the profiler stops mid-step
    return ctx


# ------------------------------------------------------------------------------------------------ the layer's step
def lean_decode_forward(layer, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        batch) -> torch.Tensor | None:
    """The layer's output for a decode-only step, or None where a part is not of the kinds above (the caller runs the
    fused forward). hidden_states: [1, T, hidden], one decode token per row. A layer of native silu also computes
    the lean layers that follow it in the decoder's order (`_run_after`): their own calls pass its output through."""
    ctx = batch.scratch
    if ctx.__class__ is _StepContext and ctx.run_rest and hidden_states is ctx.run_out:
        return _pass_through(ctx, layer, hidden_states)
    dtype = hidden_states.dtype
    plan = layer_plan(layer, dtype)
    tokens = hidden_states.shape[1]
    if (plan.struct is None or tokens >= plan.max_tokens or not hidden_states.is_contiguous()
            or hidden_states.device.type != "cpu"):
        return None
    ctx = _context(batch, cos, sin, tokens, dtype)
    if ctx is None or ctx.head_dim != plan.head_dim:   # (a partial rotary is not the kernel's formula)
        return None
    ctx.fit(plan.widths)
    layer_entry, down_entry, run_entry = lean_layer_entries()
    local_layer = layer.self_attn.layer_idx - ctx.first_layer   # a pipeline stage holds only its own layers
    out = torch.empty_like(hidden_states)                        # [1, T, hidden]: the residual stream, a new tensor
    run = _run_after(layer, plan, ctx, batch, tokens, dtype) if plan.native_silu else ()
    if run:
        members = ((layer, plan), *run)
        plans = (ctypes.c_void_p * len(members))(*(p.address for _, p in members))
        local = (ctypes.c_int64 * len(members))(*(local_layer + j for j in range(len(members))))
        spare = torch.empty_like(hidden_states)                  # the residual stream between the run's layers
        status = run_entry(ctx.address, ctypes.addressof(plans), ctypes.addressof(local), len(members),
                           hidden_states.data_ptr(), out.data_ptr(), spare.data_ptr(), ctx.failed_address,
                           ctx.failed_index_address)
        if status:
            index = ctx.failed_index.value
            _raise(ctx, members[index][1], local_layer + index, status)
        ctx.run_out, ctx.run_rest = out, [member for member, _ in reversed(run)]
        return out
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


def _run_after(layer, plan: LayerPlan, ctx: _StepContext, batch, tokens: int, dtype: torch.dtype) -> list:
    """[(layer, plan)] of the lean layers of native silu that the decoder calls right after `layer` in this step
    (batch.layer_order: the decoder's ModuleList, in the order HF's loop calls it), each growing the workspace to
    its widths; empty where the order is not known or a forward hook would watch a layer's own output. A run ends at
    a layer of another kind (a pipeline stage's SkippedLayer, a morphed or HF-MLP layer): it runs as before."""
    order = batch.layer_order
    if order is None or _hooked(layer) or _global_hooks():
        return []
    layers = list(order._modules.values())
    index = layer.self_attn.layer_idx
    if index >= len(layers) or layers[index] is not layer:
        return []
    run = []
    for follower in layers[index + 1:]:
        if follower.__class__ is not layer.__class__ or _hooked(follower):
            break
        follower_plan = layer_plan(follower, dtype)
        if (follower_plan.struct is None or not follower_plan.native_silu or tokens >= follower_plan.max_tokens
                or follower_plan.head_dim != ctx.head_dim
                or follower.self_attn.layer_idx != index + 1 + len(run)):
            break
        ctx.fit(follower_plan.widths)
        run.append((follower, follower_plan))
    return run


def take_lean_run(batch, out: torch.Tensor) -> int:
    """How many layers after the one that returned `out` a lean run computed with it (0: none); a caller that
    does not call them (model/flat_forward.py) takes them here, so that no pass-through awaits them."""
    ctx = batch.scratch
    if ctx.__class__ is not _StepContext or ctx.run_out is not out or not ctx.run_rest:
        return 0
    count = len(ctx.run_rest)
    ctx.run_rest = []
    return count


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _global_hooks() -> bool:
    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)


def _pass_through(ctx: _StepContext, layer, hidden_states: torch.Tensor) -> torch.Tensor:
    """A layer the run before it computed already: its output is the run's."""
    expected = ctx.run_rest.pop()
    if expected is not layer:   # the decoder called another layer than the one its order put next
        raise RuntimeError(f"decoder layer {layer.self_attn.layer_idx} ran where layer "
                           f"{expected.self_attn.layer_idx} was next in the decoder's order: a lean run computed it "
                           "already (layers/lean_decode.py assumes HF's loop calls batch.layer_order in order)")
    return hidden_states


def _raise(ctx: _StepContext, plan: LayerPlan, local_layer: int, status: int) -> None:
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
