"""The paged attention function, registered with transformers' AttentionInterface so the HF model's own forward
runs unchanged and calls us for every attention layer. No mask function is registered with AttentionMaskInterface on
purpose: for an attention implementation without one, HF's mask preparation returns None at once. With one, it first
looks for packed sequences in the position ids, which ends in a `bool(tensor)`: a device sync every step on a GPU, and
an error inside CUDA graph capture. Causality and sequence boundaries live in the PagedBatch; no dense mask is ever
built."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_hf.kv.paged_batch import PagedBatch
from elastic_hf.native.causal_prefill import causal_prefill_attention_batch, native_prefill_available
from elastic_hf.native.kv_write import native_kv_write_available, write_kv_rows
from elastic_hf.native.paged_decode import native_decode_available, paged_decode_attention
from elastic_hf.native.triton_paged import (paged_decode_attention_triton, paged_kv_write,
                                            triton_paged_available)

ATTN_IMPLEMENTATION = "elastic_paged"


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, paged_batch: PagedBatch | None = None, **kwargs):
    """query: [1, num_heads, T, head_dim]; key/value: [1, num_kv_heads, T, head_dim] for T packed new tokens.
    Returns ([1, T, num_heads, head_dim], None)."""
    if paged_batch is None:
        raise RuntimeError("attn_implementation='elastic_paged' needs the engine's paged_batch; run this model "
                           "through ElasticModel, not directly")
    pool = paged_batch.pool
    layout = pool.layout
    rows = pool.rows                                       # [arena rows, head_dim]
    local_layer = module.layer_idx - layout.first_layer    # a pipeline stage holds only its own layers
    layer_offset = local_layer * layout.rows_per_layer
    v_offset = layout.block_size                           # a V row sits block_size rows after its K row
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    num_heads = query.shape[1]

    # Write the new tokens' K/V into their pages.
    gpu_kernels = triton_paged_available(rows.device, head_dim, layout.block_size)
    if gpu_kernels:   # one launch for K and V, reading HF's strided projections; skips a captured batch's padding
        paged_kv_write(rows, paged_batch.write_k_rows, layer_offset, v_offset, key, value)
    elif key.dtype == rows.dtype and native_kv_write_available(rows.device):   # CPU: one call, no copies
        write_kv_rows(rows, paged_batch.write_k_rows, layer_offset, v_offset, key, value)
    else:
        write_rows = paged_batch.write_k_rows + layer_offset
        rows.index_copy_(0, write_rows, key[0].transpose(0, 1).reshape(-1, head_dim))          # [T*kv_heads, hd]
        rows.index_copy_(0, write_rows + v_offset, value[0].transpose(0, 1).reshape(-1, head_dim))

    out = query.new_empty(paged_batch.num_tokens, num_heads, head_dim)  # [T, num_heads, head_dim]
    scale = scaling if scaling is not None else head_dim ** -0.5
    native = native_prefill_available(query.dtype, query.device)
    # causal without a window on the CPU: all of them in one call of the C kernel (2-3x SDPA's flash kernel at a few
    # hundred tokens); a sliding window's mask goes to SDPA
    batched = [p for p in paged_batch.prefills if native and not p.windowed]
    if batched:
        _native_prefills(batched, query, key, value, rows, layer_offset, v_offset, out, scale)
    grouped = set()
    for group in paged_batch.prefill_groups:   # on a GPU: short fresh prefills, one masked call a group
        q, k, v = (t.index_select(2, group.rows) for t in (query, key, value))      # [1, heads, group, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=True)
        out.index_copy_(0, group.rows, o[0].transpose(0, 1))                          # [group, heads, hd]
        grouped.update(p.q_start for p in group.members)
    for p in paged_batch.prefills:
        if (native and not p.windowed) or p.q_start in grouped:
            continue   # done in one call above
        q = query[:, :, p.q_start:p.q_start + p.q_len]                    # [1, num_heads, q_len, hd]
        if p.k_rows is None:  # the whole context is in this step: attend to it directly
            k = key[:, :, p.q_start:p.q_start + p.q_len]                  # [1, kv_heads, ctx, hd]
            v = value[:, :, p.q_start:p.q_start + p.q_len]
        else:
            k_rows = p.k_rows + layer_offset
            k = rows.index_select(0, k_rows).view(1, num_kv_heads, p.ctx_len, head_dim)
            v = rows.index_select(0, k_rows + v_offset).view(1, num_kv_heads, p.ctx_len, head_dim)
        # Prefills keep the batch dim: with 4-D inputs SDPA takes its fused CPU kernel, 2-3x faster than with 3-D.
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scaling,
                                           enable_gqa=True)
        out[p.q_start:p.q_start + p.q_len] = o[0].transpose(0, 1)

    d = paged_batch.decodes
    if d is None:
        return out.unsqueeze(0), None
    rows_slice = slice(d.first_row, d.first_row + d.num_seqs)
    q = query[0, :, rows_slice].transpose(0, 1)                     # [B, num_heads, hd]
    layer_chunk_offset = local_layer * layout.chunks_per_layer
    if query.dtype == pool.chunks.dtype and native_decode_available(query.dtype, query.device):
        # fp32 or bf16 on the CPU: the C kernel reads every decode's K/V in place from its pages.
        paged_decode_attention(q, pool.chunks, d.chunk_ids, layer_chunk_offset, d.lens, out[rows_slice],
                               num_kv_heads, scale)
    elif gpu_kernels and query.dtype == pool.chunks.dtype:
        # on the GPU the Triton kernel reads the pages in place, sized by device tensors: CUDA-graph safe
        paged_decode_attention_triton(q, pool.chunks, d.chunk_ids, layer_chunk_offset, d.lens, out[rows_slice],
                                      num_kv_heads, scale)
    else:
        # One gather of whole [block_size, head_dim] slabs brings every decode's K and V of this layer.
        context = pool.chunks.index_select(0, d.chunk_ids + layer_chunk_offset).view(
            d.num_seqs, num_kv_heads, 2, d.ctx_len, head_dim)
        out[rows_slice] = decode_attention(q, context[:, :, 0], context[:, :, 1], d.score_bias(layout), scale)
    return out.unsqueeze(0), None


def _native_prefills(prefills: list, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: torch.Tensor,
                     layer_offset: int, v_offset: int, out: torch.Tensor, scale: float) -> None:
    """The step's prefill chunks through the C kernel in one call. bf16 widens once for all of them (the kernel
    computes in fp32); a chunk that continues a cached context reads its K/V gathered from the pages."""
    widen = query.dtype != torch.float32
    first = min(p.q_start for p in prefills)
    end = max(p.q_start + p.q_len for p in prefills)
    # [end - first, heads, hd] token-major views of HF's [1, heads, T, hd] projections, over the prefills' rows
    q_all, k_all, v_all = (t[0, :, first:end].transpose(0, 1) for t in (query, key, value))
    if widen:
        q_all, k_all, v_all = q_all.float(), k_all.float(), v_all.float()
    out_all = torch.empty(out[first:end].shape, dtype=torch.float32) if widen else out[first:end]
    num_kv_heads, head_dim = k_all.shape[1], k_all.shape[2]
    queries, keys, values, outs = [], [], [], []
    for p in prefills:
        span = slice(p.q_start - first, p.q_start - first + p.q_len)
        if p.k_rows is None:  # the whole context is in this step
            k, v = k_all[span], v_all[span]                                     # [ctx, kv_heads, hd]
        else:
            k_rows = p.k_rows + layer_offset
            k = rows.index_select(0, k_rows).view(num_kv_heads, p.ctx_len, head_dim).transpose(0, 1)
            v = rows.index_select(0, k_rows + v_offset).view(num_kv_heads, p.ctx_len, head_dim).transpose(0, 1)
            if widen:
                k, v = k.float(), v.float()
        queries.append(q_all[span])
        keys.append(k)
        values.append(v)
        outs.append(out_all[span])
    causal_prefill_attention_batch(queries, keys, values, outs, scale)
    if widen:   # rows of a windowed prefill in between are written after this, by SDPA
        out[first:end] = out_all


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_bias: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """One new token per sequence. q: [B, num_heads, hd]; k, v: [B, kv_heads, ctx, hd] (may be strided views);
    score_bias: [B * kv_heads, 1, ctx] additive (0 / -inf) or None. Returns [B, num_heads, hd]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, ctx = k.shape[1], k.shape[2]
    if q.device.type != "cpu":
        mask = None if score_bias is None else score_bias.view(batch, num_kv_heads, 1, ctx)[:, :1]
        return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True).squeeze(2)
    # On CPU, SDPA's flash kernel tiles over query rows and a decode has one per head: two bmm over
    # (sequence, kv head) pairs are ~1.5x faster. The heads sharing a KV head are adjacent (HF's repeat_kv:
    # head = kv_head * group + g), so each pair is one [group, hd] x [hd, ctx] product.
    group = num_heads // num_kv_heads
    qb = (q * scale).reshape(batch * num_kv_heads, group, head_dim)              # [B*kvH, group, hd]
    kb = k.reshape(batch * num_kv_heads, ctx, head_dim)                          # views: B and kvH strides merge
    vb = v.reshape(batch * num_kv_heads, ctx, head_dim)
    scores = torch.bmm(qb, kb.transpose(1, 2))                                   # [B*kvH, group, ctx]
    if score_bias is not None:
        scores.add_(score_bias)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(vb.dtype)
    return torch.bmm(probs, vb).view(batch, num_heads, head_dim)


def load_native_attention(dtype: torch.dtype, device: torch.device) -> bool:
    """Compile (once per machine) or load the C attention kernels for `dtype` now, at build time, rather than inside
    the first request's step. True when all three (prefill, decode, K/V write) are there."""
    return (native_prefill_available(dtype, device) and native_decode_available(dtype, device)
            and native_kv_write_available(device))


def register_paged_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
