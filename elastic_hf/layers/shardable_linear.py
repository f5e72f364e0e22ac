"""A Linear whose weight lives in a weights arena in a padded, chunked layout (see layers/shard_layout.py) so that
it can compute as any tensor-parallel shard of itself and give back the pages of the chunks it no longer owns.

column: y[..., own out rows] = x @ W[own rows].T (+ bias rows); the caller's next op consumes the shard.
row:    y = all_reduce(x[..., own in cols] @ W[:, own cols].T) + bias; the weight is stored transposed,
        [in_features, out_features], so a shard of input columns is a contiguous range of storage rows.

Packed (a CPU deployment whose chunk shapes native/decode_gemm.c reads): each chunk's bytes are rewritten in place,
when they land, into the kernel's layout of that chunk's [out, in] matrix (a permutation: layers/packed_linear.py
"packed in place"), so the pages stay the same and every product reads them at the memory system's pace instead of
oneDNN's or ATen's plain-weight kernels (~2x a decode step in bf16, 1.5-1.8x in fp32: benchmarks/RESULTS.md).
Column chunks hold whole 64-output blocks, so a run of them is itself one packed weight (one GEMM); a row chunk is
its own [out, chunk's in] weight (one GEMM a chunk, summed). What leaves a worker (a chunk sent to a peer) leaves
plain, and what arrives is packed on arrival: the layout never crosses a process (workers need not agree on it).
"""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.cpu_gemm import fp32_linear
from elastic_hf.layers.packed_linear import DirectProduct, FusedProduct, packs_in_place
from elastic_hf.native.decode_gemm import decode_gemm, packed_layout, plain_layout
from elastic_hf.memory.arena import PageArena
from elastic_hf.layers.shard_layout import PaddedLayout, Run

MODES = ("column", "row")


class ShardableLinear(nn.Module):
    def __init__(self, layout: PaddedLayout, mode: str, arena: PageArena, base_offset: int, in_features: int,
                 out_features: int, dtype: torch.dtype, bias: torch.Tensor | None = None, packed: bool = False):
        """packed: keep the chunks in native/decode_gemm.c's layout where every chunk's shape allows it
        (`self.packed` says whether it did)."""
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        rows, row_numel = (out_features, in_features) if mode == "column" else (in_features, out_features)
        if layout.num_units * layout.unit_rows != rows or layout.row_numel != row_numel:
            raise ValueError(f"layout of {layout.num_units} units x {layout.unit_rows} rows x {layout.row_numel} "
                             f"does not match a {mode} weight of [{out_features}, {in_features}]")
        if base_offset % arena.page_size:
            raise ValueError(f"base_offset {base_offset} is not aligned to the {arena.page_size}-byte page")
        self.layout = layout
        self.mode = mode
        self.arena = arena
        self.base_offset = base_offset
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.bias = bias                       # full, replicated; sliced per shard (column) or added once (row)
        self.committed: set[int] = set()       # chunk ids whose pages hold weights
        # chunk ids whose pages are committed for bytes still arriving (chunk_buffer(commit=True) before
        # mark_loaded): a receive that fails leaves them here, and release still gives their pages back
        self.landing: set[int] = set()
        self.tp, self.rank, self.group = 1, 0, None
        self._runs: list[Run] = []
        self._views: list[torch.Tensor] = []
        self._bias_runs: list[torch.Tensor | None] = []
        self.packed = packed and self._chunks_pack()
        # packed: (address, outputs) of each run (column) or (address, inputs) of each chunk (row) of the shard
        self._products: list[tuple[int, int]] = []
        # the product this linear shares with the others reading its input (fuse_shards), and its first column there
        self.fused: FusedProduct | None = None
        self.column_start = 0

    def _chunks_pack(self) -> bool:
        """Whether every chunk, as the [out, in] matrix a product reads, is a shape the native kernel reads in place
        (and a column bias, sliced per run, has the weight's dtype: the kernel adds it)."""
        lay = self.layout
        if self.bias is not None and self.mode == "column" and self.bias.dtype != self.dtype:
            return False
        shapes = [(c.stored_rows, lay.row_numel) if self.mode == "column" else (lay.row_numel, c.stored_rows)
                  for c in lay.chunks]
        return all(packs_in_place(n, k, self.dtype) for n, k in shapes)

    # ------------------------------------------------------------------ pages
    def _chunk_span(self, i: int) -> tuple[int, int]:
        c = self.layout.chunks[i]
        return self.base_offset + c.byte_offset, c.nbytes

    @torch.no_grad()
    def load(self, weight: torch.Tensor, chunk_ids: list[int]) -> None:
        """Commit the pages of `chunk_ids` and fill them from the full weight [out_features, in_features]."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} does not match "
                             f"[{self.out_features}, {self.in_features}]")
        lay = self.layout
        for i in chunk_ids:
            c = lay.chunks[i]
            offset, nbytes = self._chunk_span(i)
            self.arena.commit(offset, nbytes)
            dst = self.arena.view(offset, (c.stored_rows, lay.row_numel), self.dtype)  # [stored_rows, row_numel]
            lo, hi = c.unit_start * lay.unit_rows, c.unit_end * lay.unit_rows
            src = weight[lo:hi] if self.mode == "column" else weight[:, lo:hi].t()     # [num_rows, row_numel]
            dst[:c.num_rows].copy_(src)
            dst[c.num_rows:].zero_()  # fresh VMM pages are not zero; eq. 2 needs zero pad rows
            self.mark_loaded(i)

    def chunk_buffer(self, i: int, commit: bool = False) -> torch.Tensor:
        """[stored_rows, row_numel] view of one chunk's bytes, pads included, to receive its plain rows after
        commit=True (call mark_loaded once they are in: it packs them)."""
        c = self.layout.chunks[i]
        offset, nbytes = self._chunk_span(i)
        if commit:
            self.arena.commit(offset, nbytes)
            if i not in self.committed:
                self.landing.add(i)
        return self.arena.view(offset, (c.stored_rows, self.layout.row_numel), self.dtype)

    def plain_chunk(self, i: int) -> torch.Tensor:
        """[stored_rows, row_numel] plain rows of a loaded chunk (to send it): its bytes where it is not packed,
        else a new tensor unpacked from them."""
        view = self.chunk_buffer(i)
        if not self.packed:
            return view
        rows, row_numel = view.shape
        if self.mode == "column":
            return plain_layout(view.view(-1), rows, row_numel)
        return plain_layout(view.view(-1), row_numel, rows).t().contiguous()   # stored transposed

    @torch.no_grad()
    def mark_loaded(self, i: int) -> None:
        """Chunk i holds its plain rows now: packed in place first where this linear packs."""
        if self.packed:
            view = self.chunk_buffer(i)                      # [stored_rows, row_numel]
            matrix = view if self.mode == "column" else view.t().contiguous()   # the product's [out, in]
            view.view(-1).copy_(packed_layout(matrix))      # packed_layout permutes into a new tensor: no aliasing
        self.landing.discard(i)
        self.committed.add(i)

    def release(self, chunk_ids: list[int]) -> int:
        """Decommit the pages of `chunk_ids`; returns the bytes given back."""
        active = {i for i in range(len(self.layout.chunks)) if self._owns(i)}
        if active & set(chunk_ids):
            raise ValueError(f"chunks {sorted(active & set(chunk_ids))} belong to the active shard "
                             f"tp={self.tp} rank={self.rank}")
        freed = 0
        for i in chunk_ids:
            if i in self.held:
                offset, nbytes = self._chunk_span(i)
                self.arena.decommit(offset, nbytes)
                self.committed.discard(i)
                self.landing.discard(i)
                freed += nbytes
        return freed

    @property
    def held(self) -> set[int]:
        """Chunk ids whose pages are committed: loaded, or landing."""
        return self.committed | self.landing

    @property
    def committed_bytes(self) -> int:
        return sum(self.layout.chunks[i].nbytes for i in self.held)

    # ------------------------------------------------------------------ shard
    def _owns(self, chunk_id: int) -> bool:
        return bool(self._runs) and chunk_id in self.layout.shard_chunks(self.tp, self.rank)

    def set_shard(self, tp: int, rank: int, group=None) -> None:
        """Compute as shard `rank` of `tp` from now on; its chunks must be loaded. `group` is the TP process group
        of a row-parallel layer (None at tp=1)."""
        chunk_ids = self.layout.shard_chunks(tp, rank)
        missing = sorted(set(chunk_ids) - self.committed)
        if missing:
            raise ValueError(f"shard tp={tp} rank={rank} needs chunks {chunk_ids}; {missing} are not loaded")
        if tp > 1 and self.mode == "row" and group is None:
            raise ValueError(f"a row-parallel shard at tp={tp} needs its process group for the all-reduce")
        lay = self.layout
        runs = lay.runs(chunk_ids)
        views = [self.arena.view(self.base_offset + r.byte_offset, (r.num_rows, lay.row_numel), self.dtype)
                 for r in runs]
        bias_runs: list[torch.Tensor | None] = []
        for r in runs:
            if self.bias is None or self.mode == "row":
                bias_runs.append(None)
                continue
            parts = []
            for i in chunk_ids:
                c = lay.chunks[i]
                if r.unit_start <= c.unit_start and c.unit_end <= r.unit_end:
                    parts.append(self.bias[c.unit_start * lay.unit_rows:c.unit_end * lay.unit_rows])
                    parts.append(self.bias.new_zeros(c.stored_rows - c.num_rows))
            bias_runs.append(torch.cat(parts))
        if not self.packed:
            products = []
        elif self.mode == "column":
            products = [(v.data_ptr(), r.num_rows) for v, r in zip(views, runs)]
        else:
            products = [(self.chunk_buffer(i).data_ptr(), lay.chunks[i].stored_rows) for i in chunk_ids]
        self.tp, self.rank, self.group = tp, rank, group
        self._runs, self._views, self._bias_runs, self._products = runs, views, bias_runs, products

    def deactivate(self) -> None:
        """No active shard (standby): every chunk may be released; forward() refuses until set_shard()."""
        self.tp, self.rank, self.group = 1, 0, None
        self._runs, self._views, self._bias_runs, self._products = [], [], [], []

    @property
    def shard_width(self) -> int:
        """Output columns (column mode) or input columns (row mode) of the active shard, padding included."""
        return sum(r.num_rows for r in self._runs)

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._views:
            raise RuntimeError("ShardableLinear has no active shard: call set_shard() after load()")
        if self.fused is not None:   # [..., shard_width]: this member's columns of the group's product
            return self.fused.read(x)[..., self.column_start:self.column_start + self.shard_width]
        if self.packed and x.dtype != self.dtype:
            raise TypeError(f"a packed ShardableLinear multiplies {self.dtype} inputs only, got {x.dtype}")
        if self.mode == "column":
            if self.packed:
                outs = [decode_gemm(x, ptr, b, rows) for (ptr, rows), b in zip(self._products, self._bias_runs)]
            else:
                outs = [fp32_linear(x, w, b) for w, b in zip(self._views, self._bias_runs)]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)          # [..., shard_width]
        if x.shape[-1] != self.shard_width:
            raise ValueError(f"row-parallel input has {x.shape[-1]} columns, shard expects {self.shard_width}")
        y = self._packed_partials(x) if self.packed else self._partials(x)         # [..., out_features]
        if self.tp > 1:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y.add_(self.bias)

    def _partials(self, x: torch.Tensor) -> torch.Tensor:
        """Row mode, plain: the sum over the shard's runs of x's columns times the run's stored rows."""
        y, col = None, 0
        for w in self._views:                                                       # w: [run_rows, out_features]
            part = torch.matmul(x[..., col:col + w.shape[0]], w)                   # [..., out_features]
            y = part if y is None else y.add_(part)
            col += w.shape[0]
        return y

    def _packed_partials(self, x: torch.Tensor) -> torch.Tensor:
        """Row mode, packed: the sum over the shard's chunks, each its own packed [out_features, chunk rows]."""
        y, col, out_features = None, 0, self.layout.row_numel
        for ptr, rows in self._products:
            part = decode_gemm(x[..., col:col + rows], ptr, None, out_features)     # [..., out_features]
            y = part if y is None else y.add_(part)
            col += rows
        return y

    def extra_repr(self) -> str:
        return (f"{self.mode}, in={self.in_features}, out={self.out_features}, tp={self.tp}, rank={self.rank}, "
                f"chunks={len(self.layout.chunks)}, committed={sorted(self.committed)}")


def fuse_shards(group: list[ShardableLinear]) -> bool:
    """Let packed column linears that read one input (a layer's q/k/v, its gate/up) share one product where their
    active shards are one run each and lie back to back in the arena, in the group's order (at TP1 they do: every
    chunk is held and the arena places the kinds in order); else each computes its own. Called again after every
    shard switch, which changes both. Returns whether the group is fused now."""
    for lin in group:
        lin.fused = None
    first = group[0]
    if len(group) < 2 or not all(lin.packed and lin.mode == "column" and len(lin._products) == 1 and
                                 lin.arena is first.arena and lin.layout.row_numel == first.layout.row_numel
                                 and (lin.bias is None) == (first.bias is None) for lin in group):
        return False
    end = first._products[0][0]
    for lin in group:
        address, rows = lin._products[0]
        if address != end:
            return False
        end = address + rows * lin.layout.row_bytes
    rows = sum(lin._products[0][1] for lin in group)
    weight = first.arena.view(first.base_offset + first._runs[0].byte_offset, (rows * first.layout.row_numel,),
                              first.dtype)                                    # the members' packed bytes, flat
    bias = None if first.bias is None else torch.cat([lin._bias_runs[0] for lin in group])
    product = FusedProduct(weight, bias, len(group))
    product.direct = DirectProduct(weight, first.dtype, rows)
    start = 0
    for lin in group:
        lin.fused, lin.column_start = product, start
        start += lin.shard_width
    return True
