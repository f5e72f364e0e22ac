"""A decode-only CPU step of a switched Llama-family layer (layers/fused_decoder_layer.py) as ten direct calls of the
native kernels, with every argument computed from shapes the layer and the step already know.

The fused layer forward still spends ~230 us of Python a layer on a 2-core EPYC (30 layers: ~7 ms a step, a quarter
of a batch-1 bf16 step of the default model): six module calls, and nine kernel wrappers that each validate their
inputs, allocate their output (`torch.empty`, ~3 us), build views and strides (the RMSNorm wrapper takes 18 us for a
kernel of 2). Here the same kernels run on the same bytes in the same order: RMSNorm -> the fused q/k/v product ->
rotary -> the K/V write -> paged decode attention -> o -> residual add -> RMSNorm -> the fused gate/up product ->
silu * up -> down -> residual add, so the outputs are bit-identical to the fused forward's (and so HF's:
tests/layers/test_lean_decode.py). What the layer leaves between kernels lives in one workspace a step shares across
its layers (they run one after another); the residual stream is a fresh tensor per layer, as HF's is.

It runs only where every part is the kind it knows: native RMSNorms; q/k/v and gate/up as one packed product each,
or (a morphing instance packs every linear alone, so that each layer can swap precision) as packed linears written
side by side into one buffer, with HF's MLP formula (act_fn(gate) * up in torch) where the MLP is HF's; o/down packed;
all read by native/decode_gemm.c below their oneDNN row threshold; the native rotary; the C attention backend over a
KV arena of the activations' dtype; a step whose every row is one decode of a uniformly attending model. Anything
else returns None and the fused forward runs: a prefill in the step, a morphed (quantized) layer, sharded linears,
soft-capping, a decode past a sliding window. ELASTIC_HF_LEAN_DECODE=0 turns it off (A/B)."""
from __future__ import annotations

import os
from functools import cache

import torch

from elastic_hf.layers.native_norm import NativeRMSNorm
from elastic_hf.layers.packed_linear import FusedMemberLinear, PackedLinear
from elastic_hf.layers.swiglu_mlp import SwiGLUMLP
from elastic_hf.native.decode_gemm import check_gemm_status, gemm_entry
from elastic_hf.native.fused_elementwise import elementwise_entries, native_elementwise_available
from elastic_hf.native.kv_write import check_kv_write_status, kv_write_entry, native_kv_write_available
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


class _StepContext:
    """What every layer of one decode step shares: the batch's addresses, the thread count, the kernels of the
    dtype and the workspace. Built by the step's first layer (`_context`)."""

    __slots__ = ("cos", "sin", "tokens", "dtype", "elem", "threads", "gemm", "norm", "silu", "rotary",
                 "kv_write", "attend", "arena_rows", "arena_row_count", "chunks", "write_rows", "chunk_ids", "lens",
                 "layout", "buffers")

    def buffer(self, name: str, width: int) -> torch.Tensor:
        """[tokens, width] of the step's dtype, one per name for the whole step (its layers run in turn)."""
        buf = self.buffers.get(name)
        if buf is None or buf.shape[1] != width:
            buf = self.buffers[name] = torch.empty(self.tokens, width, dtype=self.dtype)
        return buf

    def product(self, x_ptr: int, k: int, direct, bias: torch.Tensor | None, y_ptr: int, ldy: int) -> None:
        """y[:, :n] = x @ W.T (+ bias) for the step's rows: x [T, k] contiguous at x_ptr, y rows ldy apart."""
        n = direct.out_features
        check_gemm_status(self.gemm(x_ptr, k, direct.weight_ptr, _ptr(bias), y_ptr, ldy, self.tokens, n, k,
                                    self.threads), self.tokens, k, n)


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
    if gemm is None or attend is None:
        return None
    ctx = _StepContext()
    ctx.cos, ctx.sin, ctx.tokens, ctx.dtype = cos, sin, tokens, dtype
    ctx.elem = dtype.itemsize
    ctx.threads = torch.get_num_threads()
    ctx.gemm, ctx.attend = gemm, attend
    ctx.norm, ctx.silu = elementwise_entries(dtype)
    ctx.rotary, ctx.kv_write = rotary_entry(dtype), kv_write_entry()
    ctx.arena_rows, ctx.arena_row_count, ctx.chunks = pool.rows, pool.rows.shape[0], pool.chunks
    ctx.write_rows, ctx.chunk_ids, ctx.lens = batch.write_k_rows, d.chunk_ids, d.lens
    ctx.layout = pool.layout
    ctx.buffers = {}
    return ctx


def _packed(module, dtype: torch.dtype, tokens: int):
    """The DirectProduct of a packed linear the native kernel reads at this row count, else None."""
    direct = getattr(module, "direct", None)
    return direct if direct is not None and direct.runs(dtype, tokens) else None


# HF MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)): a morphing instance keeps them
HF_SWIGLU_MLP_CLASSES = ("LlamaMLP", "Qwen2MLP", "MistralMLP")


def _projections(attn, dtype: torch.dtype, tokens: int) -> list | None:
    """q/k/v as [(DirectProduct, bias, first output column)]: one fused product, or three packed linears (a morphing
    instance packs each alone) written side by side into one [T, q | k | v] buffer; None where one is neither."""
    q_proj, k_proj, v_proj = attn.q_proj, attn.k_proj, attn.v_proj
    if type(q_proj) is FusedMemberLinear:
        qkv = q_proj.fused
        if qkv.num_members != 3 or k_proj.fused is not qkv or v_proj.fused is not qkv or not qkv.packed:
            return None
        parts = [(_packed(qkv, dtype, tokens), qkv.bias, 0)]
    elif type(q_proj) is PackedLinear and type(k_proj) is PackedLinear and type(v_proj) is PackedLinear:
        q_size, kv_size = q_proj.out_features, k_proj.out_features
        parts = [(_packed(m, dtype, tokens), m.bias, start)
                 for m, start in ((q_proj, 0), (k_proj, q_size), (v_proj, q_size + kv_size))]
    else:
        return None
    return parts if all(direct is not None for direct, _, _ in parts) else None


def _mlp_products(mlp, dtype: torch.dtype, tokens: int) -> tuple[list, bool] | None:
    """gate/up as [(DirectProduct, bias, first output column)] into one [T, gate | up] buffer, and whether silu * up
    runs in the native kernel (SwiGLUMLP) or as HF's act_fn and product (HF's MLP on packed linears)."""
    if type(mlp) is SwiGLUMLP:
        gate_up = mlp.gate_proj.fused
        if gate_up.num_members != 2 or mlp.up_proj.fused is not gate_up or not gate_up.packed:
            return None
        parts, native = [(_packed(gate_up, dtype, tokens), gate_up.bias, 0)], True
    elif (type(mlp).__name__ in HF_SWIGLU_MLP_CLASSES and type(mlp).__module__.startswith("transformers.models.")
          and type(mlp.gate_proj) is PackedLinear and type(mlp.up_proj) is PackedLinear):
        parts = [(_packed(mlp.gate_proj, dtype, tokens), mlp.gate_proj.bias, 0),
                 (_packed(mlp.up_proj, dtype, tokens), mlp.up_proj.bias, mlp.gate_proj.out_features)]
        native = False
    else:
        return None
    return (parts, native) if all(direct is not None for direct, _, _ in parts) else None


def lean_decode_forward(layer, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        batch) -> torch.Tensor | None:
    """The layer's output for a decode-only step, or None where a part is not of the kinds above (the caller runs the
    fused forward). hidden_states: [1, T, hidden], one decode token per row."""
    dtype = hidden_states.dtype
    tokens, hidden = hidden_states.shape[1], hidden_states.shape[2]
    attn, mlp = layer.self_attn, layer.mlp
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    o_proj, down_proj = attn.o_proj, getattr(mlp, "down_proj", None)
    if (type(norm1) is not NativeRMSNorm or type(norm2) is not NativeRMSNorm or norm1.weight.dtype != dtype
            or norm2.weight.dtype != dtype or type(o_proj) is not PackedLinear or type(down_proj) is not PackedLinear
            or not hidden_states.is_contiguous() or hidden_states.device.type != "cpu"):
        return None
    qkv_parts, mlp_parts = _projections(attn, dtype, tokens), _mlp_products(mlp, dtype, tokens)
    o_w, down_w = _packed(o_proj, dtype, tokens), _packed(down_proj, dtype, tokens)
    if qkv_parts is None or mlp_parts is None or o_w is None or down_w is None:
        return None
    gate_up_parts, native_silu = mlp_parts
    ctx = _context(batch, cos, sin, tokens, dtype)
    if ctx is None:
        return None
    head_dim = attn.head_dim
    if cos.shape[2] != head_dim:   # a partial rotary: not the kernel's formula
        return None
    q_size, kv_size = attn.q_proj.out_features, attn.k_proj.out_features
    heads, kv_heads = q_size // head_dim, kv_size // head_dim
    qkv_width = q_size + 2 * kv_size
    inter2 = sum(direct.out_features for direct, _, _ in gate_up_parts)
    inter = inter2 // 2
    if q_size != o_proj.in_features or down_proj.in_features != inter or o_w.out_features != hidden \
            or down_w.out_features != hidden or sum(d.out_features for d, _, _ in qkv_parts) != qkv_width:
        return None
    elem, threads = ctx.elem, ctx.threads
    layout = ctx.layout
    local_layer = attn.layer_idx - layout.first_layer          # a pipeline stage holds only its own layers
    h = ctx.buffer("h", hidden)                                # [T, hidden]
    qkv_out = ctx.buffer("qkv", qkv_width)                     # [T, q | k | v]
    q_rot = ctx.buffer("q", q_size)                            # [T, heads, hd] token-major
    k_rot = ctx.buffer("k", kv_size)                           # [T, kv_heads, hd]
    att = ctx.buffer("attn", q_size)                           # [T, heads, hd]
    o = ctx.buffer("o", hidden)
    gu = ctx.buffer("gate_up", inter2)                         # [T, gate | up]
    down = ctx.buffer("down", hidden)
    x_ptr, h_ptr, qkv_ptr, gu_ptr = hidden_states.data_ptr(), h.data_ptr(), qkv_out.data_ptr(), gu.data_ptr()

    ctx.norm(x_ptr, hidden, norm1.weight.data_ptr(), h_ptr, hidden, tokens, hidden, norm1.variance_epsilon, threads)
    for direct, bias, column in qkv_parts:   # each output column's sum is the same whichever call computes it
        ctx.product(h_ptr, hidden, direct, bias, qkv_ptr + column * elem, qkv_width)
    k_ptr, v_ptr = qkv_ptr + q_size * elem, qkv_ptr + (q_size + kv_size) * elem
    ctx.rotary(qkv_ptr, head_dim, qkv_width, heads, k_ptr, head_dim, qkv_width, kv_heads,
               ctx.cos.data_ptr(), ctx.sin.data_ptr(), ctx.cos.stride(1),
               q_rot.data_ptr(), head_dim, q_size, k_rot.data_ptr(), head_dim, kv_size, tokens, head_dim, threads)
    status = ctx.kv_write(ctx.arena_rows.data_ptr(), head_dim * elem, ctx.arena_row_count, ctx.write_rows.data_ptr(),
                          tokens * kv_heads, local_layer * layout.rows_per_layer, layout.block_size, kv_heads,
                          k_rot.data_ptr(), kv_size * elem, head_dim * elem, v_ptr, qkv_width * elem, head_dim * elem,
                          threads)
    check_kv_write_status(status, ctx.write_rows, local_layer * layout.rows_per_layer, layout.block_size,
                          ctx.arena_row_count)
    max_blocks = ctx.chunk_ids.numel() // (tokens * kv_heads * 2)
    status = ctx.attend(q_rot.data_ptr(), q_size, head_dim, ctx.chunks.data_ptr(), ctx.chunk_ids.data_ptr(),
                        local_layer * layout.chunks_per_layer, ctx.lens.data_ptr(), att.data_ptr(), q_size, tokens,
                        heads, kv_heads, head_dim, layout.block_size, max_blocks, attn.scaling, threads)
    check_decode_status(status, head_dim, max_blocks, layout.block_size)
    ctx.product(att.data_ptr(), q_size, o_w, o_proj.bias, o.data_ptr(), hidden)
    out = hidden_states + o.view(1, tokens, hidden)            # [1, T, hidden]: the residual stream, a new tensor
    ctx.norm(out.data_ptr(), hidden, norm2.weight.data_ptr(), h_ptr, hidden, tokens, hidden, norm2.variance_epsilon,
             threads)
    for direct, bias, column in gate_up_parts:
        ctx.product(h_ptr, hidden, direct, bias, gu_ptr + column * elem, inter2)
    if native_silu:
        act = ctx.buffer("act", inter)
        ctx.silu(gu_ptr, inter2, act.data_ptr(), inter, tokens, inter, threads)
    else:   # HF's own formula, rounding where it rounds: act_fn(gate) * up
        act = (mlp.act_fn(gu[:, :inter]) * gu[:, inter:]).contiguous()   # [T, inter] (already contiguous: no copy)
    ctx.product(act.data_ptr(), inter, down_w, down_proj.bias, down.data_ptr(), hidden)
    return out.add_(down.view(1, tokens, hidden))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
