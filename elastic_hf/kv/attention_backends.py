"""Attention backends, one chosen when an instance is built (`choose_attention_backend`) and carried by every step's
PagedBatch, so no layer of any step decides its kernels again:

- `cpu_native`: the C kernels (native/): K/V written in one call reading HF's strided projections, every causal
  prefill of a step in one call, decodes read in place from their pages; windowed prefills through SDPA.
- `triton`: on CUDA, one launch writes K and V, decodes read the pages in place sized by device tensors (what CUDA
  graphs capture); short fresh prefills attend in block-diagonal masked SDPA groups, the rest alone.
- `sdpa`: the torch path for anything else (a GPU shape Triton does not tile, no C compiler, ELASTIC_HF_NATIVE=0):
  index_copy_ writes, SDPA prefills (grouped on a GPU), decodes over gathered [block_size, head_dim] slabs.

A backend builds the step's metadata (`build_metadata`: kv/paged_batch.py) and runs every layer's attention
(`forward`, called by the function registered with transformers' AttentionInterface: kv/paged_attention.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.kv.paged_batch import NO_BATCHED_DECODES, PagedBatch, PrefillSlice, build_paged_batch, is_batched_decode
from elastic_hf.native.causal_prefill import causal_prefill_attention_batch, native_prefill_available, widens
from elastic_hf.native.kv_write import native_kv_write_available, write_kv_rows
from elastic_hf.native.paged_decode import native_decode_available, paged_decode_attention
from elastic_hf.native.triton_paged import (paged_decode_attention_triton, paged_kv_write,
                                            triton_paged_available)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How a model's layers attend, read once from the model (patches/base.py: layer_windows, attention_softcap):
    windows[i] is layer i's sliding window (None: full attention); softcap: the tanh cap of the scores or None."""
    windows: tuple[int | None, ...] = ()
    softcap: float | None = None
    # The window that decides who joins the batched decode call, the same for every layer: the smallest (a decode
    # past it attends alone in every layer); none at all under soft-capping (its exact path). Derived once: the
    # runner asks for every sequence of every step.
    decode_window: int | None = field(init=False, default=None)
    distinct_windows: tuple[int | None, ...] = field(init=False, default=(None,))

    def __post_init__(self):
        windows = [w for w in self.windows if w is not None]
        decode = NO_BATCHED_DECODES if self.softcap is not None else (min(windows) if windows else None)
        object.__setattr__(self, "decode_window", decode)
        object.__setattr__(self, "distinct_windows", tuple(dict.fromkeys(self.windows)) or (None,))

    def is_batched_decode(self, num_computed: int, num_new_tokens: int) -> bool:
        return is_batched_decode(num_computed, num_new_tokens, self.decode_window)

    @property
    def is_uniform(self) -> bool:
        """One batch serves every layer and decodes batch: what a decode CUDA graph replays."""
        return len(self.distinct_windows) == 1 and self.softcap is None


class AttentionBackend:
    """The torch path (`sdpa`); the other backends replace the K/V write, the prefills or the decodes."""
    name = "sdpa"

    def __init__(self, device: torch.device):
        self.device = device
        # GPUs: short fresh prefills in one masked call a group (launches and slicing cost more than the attention)
        self.groups_prefills = device.type != "cpu"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, {self.device})"

    def build_metadata(self, pool: KVPagePool, seqs: list[tuple[int, int, list[int]]],
                       attention: LayerAttention | None = None) -> PagedBatch:
        """The step's PagedBatch: seqs are (num_computed_before, num_new_tokens, block_ids), in packed order (the
        order `attention.is_batched_decode` gives). attention: how the model's layers attend (None: plain causal)."""
        attention = attention or LayerAttention()
        decode_window = attention.decode_window
        batches = {w: build_paged_batch(pool, seqs, w, backend=self, decode_window=decode_window)
                   for w in attention.distinct_windows}
        first = batches[attention.windows[0]] if attention.windows else next(iter(batches.values()))
        first.softcap = attention.softcap
        if len(batches) > 1:
            first.by_layer = [batches[w] for w in attention.windows]
        return first

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                scaling: float | None, batch: PagedBatch) -> torch.Tensor:
        """query: [1, num_heads, T, head_dim]; key/value: [1, num_kv_heads, T, head_dim] for T packed new tokens.
        Returns [1, T, num_heads, head_dim]."""
        softcap = batch.softcap
        batch = batch.for_layer(module.layer_idx)
        pool = batch.pool
        layout = pool.layout
        local_layer = module.layer_idx - layout.first_layer    # a pipeline stage holds only its own layers
        layer_offset = local_layer * layout.rows_per_layer
        v_offset = layout.block_size                           # a V row sits block_size rows after its K row
        self.write_kv(pool.rows, batch, layer_offset, v_offset, key, value)
        out = query.new_empty(batch.num_tokens, query.shape[1], query.shape[3])   # [T, num_heads, head_dim]
        scale = scaling if scaling is not None else query.shape[3] ** -0.5
        if softcap is not None:   # every sequence is a prefill slice here (LayerAttention.decode_window)
            for p in batch.prefills:
                _softcapped_prefill(p, query, key, value, pool.rows, layer_offset, v_offset, out, scale, softcap)
            return out.unsqueeze(0)
        done = self.batched_prefills(batch, query, key, value, pool.rows, layer_offset, v_offset, out, scale)
        for group in batch.prefill_groups:   # short fresh prefills, one masked call a group
            q, k, v = (t.index_select(2, group.rows) for t in (query, key, value))   # [1, heads, group, hd]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scaling, enable_gqa=True)
            out.index_copy_(0, group.rows, o[0].transpose(0, 1))                       # [group, heads, hd]
            done.update(p.q_start for p in group.members)
        for p in batch.prefills:
            if p.q_start not in done:
                self._sdpa_prefill(p, query, key, value, pool.rows, layer_offset, v_offset, out, scaling)
        d = batch.decodes
        if d is not None:
            rows_slice = slice(d.first_row, d.first_row + d.num_seqs)
            q = query[0, :, rows_slice].transpose(0, 1)                                # [B, num_heads, hd]
            self.decode(q, pool, d, local_layer * layout.chunks_per_layer, key.shape[1], scale, out[rows_slice])
        return out.unsqueeze(0)

    # ------------------------------------------------------------------ the parts a backend replaces
    def write_kv(self, rows: torch.Tensor, batch: PagedBatch, layer_offset: int, v_offset: int, key: torch.Tensor,
                 value: torch.Tensor) -> None:
        head_dim = key.shape[3]
        write_rows = batch.write_k_rows + layer_offset
        rows.index_copy_(0, write_rows, key[0].transpose(0, 1).reshape(-1, head_dim))            # [T*kv_heads, hd]
        rows.index_copy_(0, write_rows + v_offset, value[0].transpose(0, 1).reshape(-1, head_dim))

    def batched_prefills(self, batch: PagedBatch, query, key, value, rows, layer_offset: int, v_offset: int,
                         out: torch.Tensor, scale: float) -> set[int]:
        """Prefills attended in one batched call; returns their q_start (none on the torch path)."""
        return set()

    def decode(self, q: torch.Tensor, pool: KVPagePool, d, layer_chunk_offset: int, num_kv_heads: int, scale: float,
               out: torch.Tensor) -> None:
        """q: [B, num_heads, hd] -> out [B, num_heads, hd]: one gather of whole [block_size, head_dim] slabs brings
        every decode's K and V of this layer."""
        head_dim = q.shape[2]
        context = pool.chunks.index_select(0, d.chunk_ids + layer_chunk_offset).view(
            d.num_seqs, num_kv_heads, 2, d.ctx_len, head_dim)
        out[:] = decode_attention(q, context[:, :, 0], context[:, :, 1], d.score_bias(pool.layout), scale)

    @staticmethod
    def _sdpa_prefill(p: PrefillSlice, query, key, value, rows, layer_offset: int, v_offset: int, out, scaling):
        num_kv_heads, head_dim = key.shape[1], key.shape[3]
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


class CpuNativeAttention(AttentionBackend):
    name = "cpu_native"

    def write_kv(self, rows, batch, layer_offset, v_offset, key, value) -> None:
        if key.dtype != rows.dtype:   # a KV cache in another dtype than the activations: the copying path casts
            return super().write_kv(rows, batch, layer_offset, v_offset, key, value)
        write_kv_rows(rows, batch.write_k_rows, layer_offset, v_offset, key, value)   # one call, no copies

    def batched_prefills(self, batch, query, key, value, rows, layer_offset, v_offset, out, scale) -> set[int]:
        """Causal prefills without a window in one call of the C kernel (2-3x SDPA's flash kernel at a few hundred
        tokens); a sliding window's mask goes to SDPA."""
        prefills = [p for p in batch.prefills if not p.windowed]
        if prefills:
            _native_prefills(prefills, query, key, value, rows, layer_offset, v_offset, out, scale)
        return {p.q_start for p in prefills}

    def decode(self, q, pool, d, layer_chunk_offset, num_kv_heads, scale, out) -> None:
        if q.dtype != pool.chunks.dtype:
            return super().decode(q, pool, d, layer_chunk_offset, num_kv_heads, scale, out)
        # fp32 or bf16: the C kernel reads every decode's K/V in place from its pages
        paged_decode_attention(q, pool.chunks, d.chunk_ids, layer_chunk_offset, d.lens, out, num_kv_heads, scale)


class TritonAttention(AttentionBackend):
    name = "triton"

    def write_kv(self, rows, batch, layer_offset, v_offset, key, value) -> None:
        # one launch for K and V, reading HF's strided projections; skips a captured batch's padding
        paged_kv_write(rows, batch.write_k_rows, layer_offset, v_offset, key, value)

    def decode(self, q, pool, d, layer_chunk_offset, num_kv_heads, scale, out) -> None:
        if q.dtype != pool.chunks.dtype:
            return super().decode(q, pool, d, layer_chunk_offset, num_kv_heads, scale, out)
        # reads the pages in place, sized by device tensors: CUDA-graph safe
        paged_decode_attention_triton(q, pool.chunks, d.chunk_ids, layer_chunk_offset, d.lens, out, num_kv_heads,
                                      scale)


def choose_attention_backend(device: torch.device, dtype: torch.dtype, head_dim: int,
                             block_size: int) -> AttentionBackend:
    """The backend an instance on `device` runs for its whole life. On the CPU this compiles (once per machine) or
    loads the C kernels now, at build time, rather than inside the first request's step."""
    if triton_paged_available(device, head_dim, block_size):
        return TritonAttention(device)
    if device.type == "cpu" and native_prefill_available(dtype, device) and native_decode_available(dtype, device) \
            and native_kv_write_available(device):
        return CpuNativeAttention(device)
    return AttentionBackend(device)


def _native_prefills(prefills: list[PrefillSlice], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     rows: torch.Tensor, layer_offset: int, v_offset: int, out: torch.Tensor, scale: float) -> None:
    """The step's prefill chunks through the C kernel in one call. bf16 goes in as it is where the kernel has its
    bf16 path for this head_dim, else widens once for all of them; a chunk that continues a cached context reads
    its K/V gathered from the pages."""
    widen = widens(query.dtype, query.shape[3])
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


def _softcapped_prefill(p: PrefillSlice, query, key, value, rows, layer_offset: int, v_offset: int, out,
                        scale: float, softcap: float) -> None:
    """Gemma 2's attention as HF's eager path computes it: scores * scale, softcap * tanh(scores / softcap), the
    causal (and window) mask, softmax in fp32. query: [1, heads, T, hd]; writes out[p.q_start:+q_len]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[3]
    q = query[0, :, p.q_start:p.q_start + p.q_len]                        # [heads, q_len, hd]
    if p.k_rows is None:
        k = key[0, :, p.q_start:p.q_start + p.q_len]                      # [kv_heads, ctx, hd]
        v = value[0, :, p.q_start:p.q_start + p.q_len]
    else:
        k_rows = p.k_rows + layer_offset
        k = rows.index_select(0, k_rows).view(num_kv_heads, p.ctx_len, head_dim).to(q.dtype)
        v = rows.index_select(0, k_rows + v_offset).view(num_kv_heads, p.ctx_len, head_dim).to(q.dtype)
    group = q.shape[0] // num_kv_heads
    k = k.repeat_interleave(group, dim=0)                                  # [heads, ctx, hd]
    v = v.repeat_interleave(group, dim=0)
    scores = torch.matmul(q, k.transpose(1, 2)) * scale                    # [heads, q_len, ctx]
    scores = torch.tanh(scores / softcap) * softcap
    mask = p.mask
    if mask is None:
        mask = torch.ones(p.q_len, p.ctx_len, dtype=torch.bool, device=q.device).tril(p.ctx_len - p.q_len)
    scores = scores.masked_fill(~mask.to(q.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    out[p.q_start:p.q_start + p.q_len] = torch.matmul(probs, v).transpose(0, 1)   # [q_len, heads, hd]


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
