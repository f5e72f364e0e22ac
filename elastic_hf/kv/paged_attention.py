"""The paged attention function, registered with transformers' AttentionInterface so the HF model's own forward
runs unchanged and calls us for every attention layer. A matching mask function is registered with
AttentionMaskInterface: it returns None, so HF never builds a dense [T, T] mask for the packed batch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from elastic_hf.kv.paged_batch import PagedBatch

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
    layer_offset = module.layer_idx * layout.rows_per_layer
    v_offset = layout.block_size                           # a V row sits block_size rows after its K row
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    num_heads = query.shape[1]

    # Write the new tokens' K/V into their pages.
    write_rows = paged_batch.write_k_rows + layer_offset
    rows.index_copy_(0, write_rows, key[0].transpose(0, 1).reshape(-1, head_dim))              # [T*kv_heads, hd]
    rows.index_copy_(0, write_rows + v_offset, value[0].transpose(0, 1).reshape(-1, head_dim))

    out = query.new_empty(paged_batch.num_tokens, num_heads, head_dim)  # [T, num_heads, head_dim]
    for p in paged_batch.prefills:
        q = query[0, :, p.q_start:p.q_start + p.q_len]                    # [num_heads, q_len, hd]
        if p.k_rows is None:  # the whole context is in this step: attend to it directly
            k = key[0, :, p.q_start:p.q_start + p.q_len]                  # [kv_heads, ctx, hd]
            v = value[0, :, p.q_start:p.q_start + p.q_len]
        else:
            k_rows = p.k_rows + layer_offset
            k = rows.index_select(0, k_rows).view(num_kv_heads, p.ctx_len, head_dim)
            v = rows.index_select(0, k_rows + v_offset).view(num_kv_heads, p.ctx_len, head_dim)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scaling,
                                           enable_gqa=True)
        out[p.q_start:p.q_start + p.q_len] = o.transpose(0, 1)

    d = paged_batch.decodes
    if d is not None:
        k_rows = d.k_rows + layer_offset
        k = rows.index_select(0, k_rows).view(d.num_seqs, num_kv_heads, d.max_ctx, head_dim)
        v = rows.index_select(0, k_rows + v_offset).view(d.num_seqs, num_kv_heads, d.max_ctx, head_dim)
        rows_slice = slice(d.first_row, d.first_row + d.num_seqs)
        q = query[0, :, rows_slice].transpose(0, 1).unsqueeze(2)  # [B, num_heads, 1, hd]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=d.mask, scale=scaling, enable_gqa=True)
        out[rows_slice] = o.squeeze(2)                              # [B, num_heads, hd]
    return out.unsqueeze(0), None


def paged_mask(*args, **kwargs):
    """Causality and sequence boundaries live in the PagedBatch; no dense mask is ever built."""
    return None


def register_paged_attention() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, paged_mask)
    return ATTN_IMPLEMENTATION
