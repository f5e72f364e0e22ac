"""CUDA graphs for decode steps (vLLM's default on GPUs): a batch of one-token decodes runs the HF forward as one
captured graph instead of ~15 kernel launches a layer issued from Python.

A small model's decode step on a GPU is bound by launches and Python, not by the GPU: without graphs every kernel
waits for the interpreter to issue it. A graph is captured per padded batch size (1, 2, 4, 8, then multiples of 8),
lazily the first time a step of that size runs, all sharing one memory pool. Its inputs live in static buffers that
every replay overwrites: token ids, positions, the KV write rows (-1 for padding rows: the Triton write skips them),
the chunk table of the contexts and their lengths (0 for padding rows: the Triton decode reads nothing for them).
Both kernels size their work from these device tensors (native/triton_paged.py), so one capture serves any contexts
up to the table's width; a longer context widens the table (doubling) and recaptures.

A graph holds the addresses of the weights and of the KV arena it was captured with. The layers' identities and the
KV pool are its signature: a precision swap replaces a layer module (morph/layer_swapper.py) and a new pool comes
with a new arena, and either drops every graph before the next replay. Steps with a prefill, a windowed sequence or
prompt log-probabilities run eagerly."""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.kv.paged_batch import DecodeGroup, PagedBatch

log = logging.getLogger(__name__)

MIN_TABLE_BLOCKS = 64   # first width of the chunk table (1,024 tokens at block_size 16); doubled on demand


class GraphCaptureError(RuntimeError):
    """Capturing a decode graph failed (an op that syncs or is not capturable); the runner goes eager."""


def capture_sizes(max_batch: int) -> list[int]:
    """Padded batch sizes that get a graph: 1, 2, 4, 8, 16, 24, ... up to max_batch (vLLM's ladder)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 8, 8))
    return [s for s in sizes if s < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(self, model: nn.Module, layers: nn.ModuleList, max_batch: int, device: torch.device, attention):
        """attention: the instance's AttentionBackend (the Triton one: instance.py captures graphs only with it)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model = model
        self.attention = attention
        self.layers = layers
        self.device = device
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}   # padded batch size -> graph
        self.mempool = None
        self.pool: KVPagePool | None = None     # the pool the graphs read (held: its identity is compared)
        self.signature: tuple | None = None
        self.table_blocks = 0
        self.num_captures = 0
        self.num_replays = 0
        self.capture_seconds = 0.0
        self.inputs: dict[str, torch.Tensor] = {}

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.max_batch

    def _signature(self) -> tuple:
        return tuple(id(layer) for layer in self.layers)

    def _reset(self, pool: KVPagePool, table_blocks: int) -> None:
        """Drop every graph and (re)make the static inputs for `pool` with a chunk table `table_blocks` wide."""
        self.graphs.clear()
        # a fresh pool: the old one goes with its graphs (capturing into a pool whose graphs are gone is an error)
        self.mempool = torch.cuda.graph_pool_handle()
        lo = pool.layout
        n, dev = self.max_batch, self.device
        self.table_blocks = table_blocks
        self.pool = pool
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.inputs = {
            "input_ids": torch.zeros(1, n, dtype=torch.long, device=dev),                   # [1, B]
            "positions": torch.zeros(1, n, dtype=torch.long, device=dev),                   # [1, B]
            "write_rows": torch.full((n * lo.num_kv_heads,), -1, dtype=torch.long, device=dev),   # [B * kv_heads]
            # [B, kv_heads, 2, table_blocks]: chunk ids (layer 0) of each context's K and V blocks
            "table": torch.zeros(n, lo.num_kv_heads, 2, table_blocks, dtype=torch.long, device=dev),
            "lens": torch.zeros(n, dtype=torch.long, device=dev),                           # [B]
            # [B, vocab] fp32: one output for every graph (each graph's own would stay allocated with it)
            "logits": torch.empty(n, vocab, dtype=torch.float32, device=dev),
        }
        self.signature = self._signature()

    def _capture(self, pool: KVPagePool, size: int) -> None:
        b = self.inputs
        lo = pool.layout
        batch = PagedBatch(pool, b["write_rows"][:size * lo.num_kv_heads], [],
                           # no score bias (all_full): lengths change between replays, so only kernels that
                           # read `lens` may be captured (the Triton one: instance.py requires it for graphs, and
                           # a KV dtype unlike the model's, which would take the torch path, is refused below)
                           DecodeGroup(0, b["table"][:size].view(-1), size, self.table_blocks * lo.block_size,
                                       b["lens"][:size], all_full=True), size, self.attention)

        def forward() -> None:
            out = self.model(input_ids=b["input_ids"][:, :size], position_ids=b["positions"][:, :size],
                             use_cache=False, logits_to_keep=0, paged_batch=batch)
            b["logits"][:size].copy_(out.logits[0])                                   # [size, vocab] -> fp32

        if pool.layout.dtype != self.model.get_input_embeddings().weight.dtype:
            # the captured attention must be the Triton kernel (queries in the KV dtype); the torch path it would
            # take otherwise reads the whole table width without a length mask
            raise GraphCaptureError(f"KV dtype {pool.layout.dtype} differs from the model's "
                                    f"{self.model.get_input_embeddings().weight.dtype}")

        # Buffers hold padding now (write rows -1, lengths 0): the warm-up and capture touch no KV page.
        b["write_rows"].fill_(-1)
        b["lens"].zero_()
        start = time.perf_counter()
        graph = torch.cuda.CUDAGraph()
        try:   # the forward runs with padding only: neither a failed warm-up nor a failed capture wrote a KV page
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):   # warm-up outside capture: lazy inits (cuBLAS handles, Triton compiles)
                forward()
            torch.cuda.current_stream(self.device).wait_stream(side)
            # thread_local: the morph copy thread may issue its own copies on a side stream meanwhile
            with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
                forward()
        except Exception as exc:
            raise GraphCaptureError(f"batch {size}: {type(exc).__name__}: {exc}") from exc
        self.graphs[size] = graph
        self.num_captures += 1
        self.capture_seconds += time.perf_counter() - start
        log.debug("captured the decode graph of batch %d (table %d blocks) in %.0f ms", size, self.table_blocks,
                  (time.perf_counter() - start) * 1e3)

    def run(self, pool: KVPagePool, input_ids: list[int], positions: list[int], batch: PagedBatch) -> torch.Tensor:
        """Logits [num_seqs, vocab] (fp32) of a step whose rows are all batched decodes (batch.decodes covers
        every row, no prefills)."""
        d = batch.decodes
        num_seqs = d.num_seqs
        lo = pool.layout
        blocks = d.chunk_ids.numel() // (num_seqs * lo.num_kv_heads * 2)
        if blocks > self.table_blocks or pool is not self.pool or self.signature != self._signature():
            width = max(MIN_TABLE_BLOCKS, self.table_blocks)
            while width < blocks:
                width *= 2
            self._reset(pool, width)
        size = next(s for s in self.sizes if s >= num_seqs)
        if size not in self.graphs:
            self._capture(pool, size)
        b = self.inputs
        pad = size - num_seqs
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad])            # [2, size]
        b["input_ids"][0, :size].copy_(host[0], non_blocking=True)
        b["positions"][0, :size].copy_(host[1], non_blocking=True)
        heads = lo.num_kv_heads
        b["write_rows"][:num_seqs * heads].copy_(batch.write_k_rows)
        b["write_rows"][num_seqs * heads:size * heads].fill_(-1)
        b["table"][:num_seqs, :, :, :blocks].copy_(d.chunk_ids.view(num_seqs, heads, 2, blocks))
        b["lens"][:num_seqs].copy_(d.lens)
        b["lens"][num_seqs:size].zero_()
        self.graphs[size].replay()
        self.num_replays += 1
        # a copy: the next replay overwrites the static output, and callers may keep logits (log-probabilities)
        return b["logits"][:num_seqs].clone()
