"""Per-step metadata of one packed varlen batch, built once per step and read by every layer's attention.

The KV arena is addressed as rows of head_dim values (see KVPagePool.rows). For layer 0 the K row of
(block b, kv head h, token offset o) is b * rows_per_block + h * 2 * block_size + o; its V row is block_size
further, and layer l adds l * rows_per_layer. Row ids are computed here once per step; each layer only adds
its offset."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from typing import TYPE_CHECKING

from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.units import ceil_div

if TYPE_CHECKING:
    from elastic_hf.kv.attention_backends import AttentionBackend


@dataclass(slots=True)
class PrefillSlice:
    q_start: int                       # first row of this sequence in the packed batch
    q_len: int
    ctx_len: int                       # tokens in the cache after this step, including the new ones
    k_rows: torch.Tensor | None        # [kv_heads * ctx_len] K rows (layer 0); None when the whole context is new
    mask: torch.Tensor | None          # [q_len, ctx_len] bool; None when plain causal (q_len == ctx_len)
    windowed: bool = False             # the mask also hides keys beyond a sliding window (else: causal only)


@dataclass(slots=True)
class DecodeGroup:
    """All sequences with exactly one new token, attended in one batched call over contexts padded to whole
    blocks. Their K/V is gathered by chunk (one [block_size, head_dim] slab of one layer, head and K/V), see
    KVPagePool.chunks."""
    first_row: int                     # decodes occupy rows [first_row, first_row + num_seqs) of the batch
    chunk_ids: torch.Tensor            # [num_seqs * kv_heads * 2 * max_blocks] (layer 0), ordered
                                       # (seq, kv head, K/V, block): the gather is [seqs, kv_heads, 2, ctx, hd]
    num_seqs: int
    ctx_len: int                       # max_blocks * block_size: the padded context every decode attends over
    lens: torch.Tensor                 # [num_seqs] int64: tokens each decode attends to (<= ctx_len)
    all_full: bool                     # every sequence fills all ctx_len positions (known on the host: no sync)
    _score_bias: torch.Tensor | None = field(default=None, init=False, repr=False)

    def score_bias(self, layout: KVLayout) -> torch.Tensor | None:
        """[num_seqs * kv_heads, 1, ctx_len] in the KV dtype of `layout` (the batch's pool), 0 or -inf at
        positions past a sequence's length; None when every sequence fills all ctx_len positions. Built on first
        use: only the torch decode path reads it (the native and Triton kernels take `lens`), and then every layer
        of the step shares it."""
        if self.all_full or self._score_bias is not None:
            return self._score_bias
        beyond = torch.arange(self.ctx_len, device=self.lens.device)[None, :] >= self.lens[:, None]  # [S, ctx_len]
        bias = torch.zeros(beyond.shape, dtype=layout.dtype, device=beyond.device).masked_fill_(beyond, float("-inf"))
        self._score_bias = bias[:, None, None, :].expand(self.num_seqs, layout.num_kv_heads, 1, self.ctx_len).reshape(
            self.num_seqs * layout.num_kv_heads, 1, self.ctx_len)
        return self._score_bias


PREFILL_GROUP_TOKENS = 1024   # a group's mask and (on SDPA's math path) scores grow with the square of its tokens


@dataclass(slots=True)
class PrefillGroup:
    """On a GPU, short fresh prefills (whole context in this step, no window) attended in one SDPA call over their
    packed rows, a block-diagonal causal mask keeping each sequence to itself: one call a layer instead of one per
    sequence, whose launches and slicing cost more than the attention at these sizes. At most PREFILL_GROUP_TOKENS
    tokens a group; longer prompts attend alone through SDPA's causal kernel. Not on the CPU, whose C kernel takes
    the prefills without a mask."""
    rows: torch.Tensor                 # [group tokens] int64: their rows in the packed batch
    mask: torch.Tensor                 # [1, 1, group tokens, group tokens] bool: same sequence and causal
    members: list[PrefillSlice]


@dataclass(slots=True)
class PagedBatch:
    pool: KVPagePool
    write_k_rows: torch.Tensor         # [num_tokens * kv_heads] K rows of the new tokens (layer 0), token-major
    prefills: list[PrefillSlice]
    decodes: DecodeGroup | None
    num_tokens: int
    # the instance's attention backend (kv/attention_backends.py), chosen once at build: it runs every layer
    backend: "AttentionBackend"
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    # A model whose layers attend differently (Gemma's sliding-window and global layers): the batch of every
    # layer, by layer index (this batch is one of them), all over the same packed order. None: one for all.
    by_layer: list["PagedBatch"] | None = None
    # Gemma 2's tanh soft-cap of the attention scores (None: none): every layer attends on the exact torch path
    softcap: float | None = None
    # What a layer path computed for the step's other layers (layers/lean_decode.py: addresses, a workspace); it
    # lives and dies with the step's batch
    scratch: object | None = None
    # The decoder's ModuleList of layers, where its forward calls each of them once in that order this step
    # (model/runner.py): a layer path may then compute a run of them in one call (layers/lean_decode.py). None:
    # each layer on its own
    layer_order: object | None = None

    def for_layer(self, layer_idx: int) -> "PagedBatch":
        return self if self.by_layer is None else self.by_layer[layer_idx]


def prefill_groups(prefills: list[PrefillSlice], device: torch.device,
                   max_tokens: int = PREFILL_GROUP_TOKENS) -> list[PrefillGroup]:
    """The fresh, unwindowed prefills packed greedily into groups of at most `max_tokens` tokens; a group needs
    two members (a lone prefill is better off with SDPA's causal kernel, which takes no mask)."""
    packs: list[list[PrefillSlice]] = [[]]
    tokens = 0   # in packs[-1]
    for p in prefills:
        if p.k_rows is not None or p.windowed or p.q_len > max_tokens:
            continue
        if tokens + p.q_len > max_tokens:
            packs.append([])
            tokens = 0
        packs[-1].append(p)
        tokens += p.q_len
    return [_prefill_group(members, device) for members in packs if len(members) > 1]


def _prefill_group(members: list[PrefillSlice], device: torch.device) -> PrefillGroup:
    lengths = torch.tensor([p.q_len for p in members])
    rows = torch.cat([torch.arange(p.q_start, p.q_start + p.q_len) for p in members])           # [Tg]
    seq = torch.repeat_interleave(torch.arange(len(members)), lengths).to(device, non_blocking=True)   # [Tg]
    pos = torch.cat([torch.arange(p.q_len) for p in members]).to(device, non_blocking=True)    # [Tg]
    mask = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])                       # [Tg, Tg]
    return PrefillGroup(rows.to(device, non_blocking=True), mask[None, None], members)


def _k_rows(pool: KVPagePool, block_table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """K rows for `positions` of sequences with `block_table`. block_table: [S, max_blocks], positions: [S, L]
    -> [S, kv_heads, L]."""
    lo = pool.layout
    blocks = torch.gather(block_table, 1, positions // lo.block_size)                # [S, L]
    token_rows = blocks * lo.rows_per_block + positions % lo.block_size              # [S, L]
    head_offsets = torch.arange(lo.num_kv_heads) * (2 * lo.block_size)               # [kv_heads]
    return token_rows[:, None, :] + head_offsets[None, :, None]


def _decode_group(pool: KVPagePool, first_row: int, tables: list[list[int]], lens: list[int]) -> DecodeGroup:
    lo = pool.layout
    num_seqs = len(tables)
    max_blocks = ceil_div(max(lens), lo.block_size)
    ctx_len = max_blocks * lo.block_size
    # Pad tables with the sequence's own first block: padded positions read valid (zeroed or written) memory
    # and are masked.
    table = torch.tensor([(t + [t[0]] * max_blocks)[:max_blocks] for t in tables])    # [S, max_blocks]
    head_kv = torch.arange(lo.chunks_per_layer).view(lo.num_kv_heads, 2)               # [kv_heads, 2]
    chunk_ids = table[:, None, None, :] * lo.chunks_per_block + head_kv[None, :, :, None]  # [S, kv_heads, 2, nb]
    return DecodeGroup(first_row, chunk_ids.flatten(), num_seqs, ctx_len, torch.tensor(lens), min(lens) == ctx_len)


NO_BATCHED_DECODES = 0   # a decode window of 0 tokens: every decode attends alone, like a prefill (soft-capping)


def is_batched_decode(num_computed: int, num_new_tokens: int, sliding_window: int | None) -> bool:
    """True for a sequence that joins the batched decode call: one new token and no sliding window cutting its
    context (a windowed sequence needs its own mask and attends like a prefill). Callers pack these sequences
    first so they form one contiguous slice of the batch. A model with several windows classifies by its smallest
    one (so the packing order holds for every layer)."""
    windowed = sliding_window is not None and num_computed + num_new_tokens > sliding_window
    return num_new_tokens == 1 and not windowed


_SAME = object()


def build_paged_batch(pool: KVPagePool, seqs: list[tuple[int, int, list[int]]],
                      sliding_window: int | None = None, backend: AttentionBackend | None = None,
                      decode_window=_SAME) -> PagedBatch:
    """seqs: (num_computed_before, num_new_tokens, block_ids) per sequence, in packed order. Index math runs on
    the CPU; the results move to the pool's device once. backend: the instance's (AttentionBackend.build_metadata
    passes itself); None: the one choose_attention_backend picks for the pool (tests and tools). decode_window: the
    window that decides which sequences join the batched decode call (default: `sliding_window`; the packing's)."""
    if decode_window is _SAME:
        decode_window = sliding_window
    if backend is None:
        from elastic_hf.kv.attention_backends import choose_attention_backend

        lo = pool.layout
        backend = choose_attention_backend(pool.rows.device, lo.dtype, lo.head_dim, lo.block_size)
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
        if is_batched_decode(num_computed, num_new, decode_window):
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
                table = torch.tensor([block_ids[:ceil_div(ctx_len, block_size)]])
                k_rows = _k_rows(pool, table, torch.arange(ctx_len).unsqueeze(0)).flatten()
            prefills.append(PrefillSlice(row, num_new, ctx_len, k_rows, mask, windowed))
        row += num_new

    lo = pool.layout
    token_rows = torch.tensor(new_blocks) * lo.rows_per_block + torch.tensor(new_positions) % block_size  # [T]
    write_k_rows = (token_rows[:, None] + torch.arange(lo.num_kv_heads)[None, :] * (2 * block_size)).flatten()

    decodes = None
    if decode_rows:
        if decode_rows != list(range(decode_rows[0], decode_rows[0] + len(decode_rows))):
            raise ValueError(f"decodes must be contiguous in the packed batch, got rows {decode_rows[:8]}...")
        decodes = _decode_group(pool, decode_rows[0], decode_tables, decode_lens)
    device = pool.rows.device
    groups = prefill_groups(prefills, device) if backend.groups_prefills else []
    if device.type != "cpu":
        write_k_rows = write_k_rows.to(device, non_blocking=True)
        for p in prefills:
            p.k_rows = None if p.k_rows is None else p.k_rows.to(device, non_blocking=True)
            p.mask = None if p.mask is None else p.mask.to(device, non_blocking=True)
        if decodes is not None:
            decodes.chunk_ids = decodes.chunk_ids.to(device, non_blocking=True)
            decodes.lens = decodes.lens.to(device, non_blocking=True)
    return PagedBatch(pool, write_k_rows, prefills, decodes, row, backend, groups)
