"""Per-step metadata of one packed varlen batch, built once per step and read by every layer's attention.

The KV arena is addressed as rows of head_dim values (see KVPagePool.rows). For layer 0 the K row of
(block b, kv head h, token offset o) is b * rows_per_block + h * 2 * block_size + o; its V row is block_size
further, and layer l adds l * rows_per_layer. Row ids are computed here once per step; each layer only adds
its offset."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from elastic_hf.kv.page_pool import KVPagePool


@dataclass(slots=True)
class PrefillSlice:
    q_start: int                       # first row of this sequence in the packed batch
    q_len: int
    ctx_len: int                       # tokens in the cache after this step, including the new ones
    k_rows: torch.Tensor | None        # [kv_heads * ctx_len] K rows (layer 0); None when the whole context is new
    mask: torch.Tensor | None          # [q_len, ctx_len] bool; None when plain causal (q_len == ctx_len)


@dataclass(slots=True)
class DecodeGroup:
    """All sequences with exactly one new token, attended in one batched call over padded contexts."""
    first_row: int                     # decodes occupy rows [first_row, first_row + num_seqs) of the batch
    k_rows: torch.Tensor               # [num_decodes * kv_heads * max_ctx] K rows (layer 0)
    num_seqs: int
    max_ctx: int
    mask: torch.Tensor | None          # [num_decodes, 1, 1, max_ctx] bool, None when all lengths are equal


@dataclass(slots=True)
class PagedBatch:
    pool: KVPagePool
    write_k_rows: torch.Tensor         # [num_tokens * kv_heads] K rows of the new tokens (layer 0), token-major
    prefills: list[PrefillSlice]
    decodes: DecodeGroup | None
    num_tokens: int


def _k_rows(pool: KVPagePool, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """K rows for `positions` of sequences with `block_table`. block_table: [S, max_blocks], positions: [S, L]
    -> [S, kv_heads, L]."""
    lo = pool.layout
    blocks = torch.gather(block_table, 1, positions // lo.block_size)                # [S, L]
    token_rows = blocks * lo.rows_per_block + positions % lo.block_size              # [S, L]
    head_offsets = torch.arange(lo.num_kv_heads) * (2 * lo.block_size)               # [kv_heads]
    return token_rows[:, None, :] + head_offsets[None, :, None]


def is_batched_decode(num_computed: int, num_new_tokens: int, sliding_window: int | None) -> bool:
    """True for a sequence that joins the batched decode call: one new token and no sliding window cutting its
    context (a windowed sequence needs its own mask and attends like a prefill). Callers pack these sequences
    first so they form one contiguous slice of the batch."""
    windowed = sliding_window is not None and num_computed + num_new_tokens > sliding_window
    return num_new_tokens == 1 and not windowed


def build_paged_batch(pool: KVPagePool, seqs: list[tuple[int, int, list[int]]],
                      sliding_window: int | None = None) -> PagedBatch:
    """seqs: (num_computed_before, num_new_tokens, block_ids) per sequence, in packed order. Index math runs on
    the CPU; the results move to the pool's device once."""
    block_size = pool.layout.block_size
    new_positions: list[int] = []
    new_blocks: list[int] = []
    prefills: list[PrefillSlice] = []
    decode_rows: list[int] = []
    decode_tables: list[list[int]] = []
    decode_lens: list[int] = []
    row = 0
    for num_computed, num_new, block_ids in seqs:
        ctx_len = num_computed + num_new
        positions = range(num_computed, ctx_len)
        new_positions.extend(positions)
        new_blocks.extend(block_ids[p // block_size] for p in positions)
        windowed = sliding_window is not None and ctx_len > sliding_window
        if is_batched_decode(num_computed, num_new, sliding_window):
            decode_rows.append(row)
            decode_tables.append(block_ids)
            decode_lens.append(ctx_len)
        else:
            mask = None
            if num_new != ctx_len or windowed:
                q_pos = torch.arange(num_computed, ctx_len).unsqueeze(1)   # [q_len, 1]
                k_pos = torch.arange(ctx_len).unsqueeze(0)                  # [1, ctx_len]
                mask = k_pos <= q_pos
                if windowed:
                    mask &= k_pos > q_pos - sliding_window
            k_rows = None
            if num_computed > 0:  # earlier chunks live only in the cache
                table = torch.tensor([block_ids[:-(-ctx_len // block_size)]])
                k_rows = _k_rows(pool, table, torch.arange(ctx_len).unsqueeze(0)).flatten()
            prefills.append(PrefillSlice(row, num_new, ctx_len, k_rows, mask))
        row += num_new

    lo = pool.layout
    token_rows = torch.tensor(new_blocks) * lo.rows_per_block + torch.tensor(new_positions) % block_size  # [T]
    write_k_rows = (token_rows[:, None] + torch.arange(lo.num_kv_heads)[None, :] * (2 * block_size)).flatten()

    decodes = None
    if decode_rows:
        max_ctx = max(decode_lens)
        max_blocks = -(-max_ctx // block_size)
        # Pad tables with the sequence's own first block: padded positions read valid memory and are masked.
        table = torch.tensor([(t + [t[0]] * max_blocks)[:max_blocks] for t in decode_tables])  # [S, max_blocks]
        positions = torch.arange(max_ctx).expand(len(decode_rows), max_ctx)                     # [S, max_ctx]
        lens = torch.tensor(decode_lens)
        mask = None
        if min(decode_lens) != max_ctx:
            mask = (positions < lens[:, None])[:, None, None, :]
        if decode_rows != list(range(decode_rows[0], decode_rows[0] + len(decode_rows))):
            raise ValueError(f"decodes must be contiguous in the packed batch, got rows {decode_rows[:8]}...")
        decodes = DecodeGroup(decode_rows[0], _k_rows(pool, table, positions).flatten(), len(decode_rows),
                              max_ctx, mask)
    device = pool.rows.device
    if device.type != "cpu":
        write_k_rows = write_k_rows.to(device, non_blocking=True)
        for p in prefills:
            p.k_rows = None if p.k_rows is None else p.k_rows.to(device, non_blocking=True)
            p.mask = None if p.mask is None else p.mask.to(device, non_blocking=True)
        if decodes is not None:
            decodes.k_rows = decodes.k_rows.to(device, non_blocking=True)
            decodes.mask = None if decodes.mask is None else decodes.mask.to(device, non_blocking=True)
    return PagedBatch(pool, write_k_rows, prefills, decodes, row)
