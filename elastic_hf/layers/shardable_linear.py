"""A Linear whose weight lives in a weights arena in a padded, chunked layout (see layers/shard_layout.py) so that
it can compute as any tensor-parallel shard of itself and give back the pages of the chunks it no longer owns.

column: y[..., own out rows] = x @ W[own rows].T (+ bias rows); the caller's next op consumes the shard.
row:    y = all_reduce(x[..., own in cols] @ W[:, own cols].T) + bias; the weight is stored transposed,
        [in_features, out_features], so a shard of input columns is a contiguous range of storage rows.
"""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.cpu_gemm import fp32_linear
from elastic_hf.memory.arena import PageArena
from elastic_hf.layers.shard_layout import PaddedLayout, Run

MODES = ("column", "row")


class ShardableLinear(nn.Module):
    def __init__(self, layout: PaddedLayout, mode: str, arena: PageArena, base_offset: int, in_features: int,
                 out_features: int, dtype: torch.dtype, bias: torch.Tensor | None = None):
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
        self.tp, self.rank, self.group = 1, 0, None
        self._runs: list[Run] = []
        self._views: list[torch.Tensor] = []
        self._bias_runs: list[torch.Tensor | None] = []

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
            self.committed.add(i)

    def chunk_buffer(self, i: int, commit: bool = False) -> torch.Tensor:
        """[stored_rows, row_numel] view of one chunk, pads included (to send it, or to receive it after
        commit=True; call mark_loaded once the bytes are in)."""
        c = self.layout.chunks[i]
        offset, nbytes = self._chunk_span(i)
        if commit:
            self.arena.commit(offset, nbytes)
        return self.arena.view(offset, (c.stored_rows, self.layout.row_numel), self.dtype)

    def mark_loaded(self, i: int) -> None:
        self.committed.add(i)

    def release(self, chunk_ids: list[int]) -> int:
        """Decommit the pages of `chunk_ids`; returns the bytes given back."""
        active = {i for i in range(len(self.layout.chunks)) if self._owns(i)}
        if active & set(chunk_ids):
            raise ValueError(f"chunks {sorted(active & set(chunk_ids))} belong to the active shard "
                             f"tp={self.tp} rank={self.rank}")
        freed = 0
        for i in chunk_ids:
            if i in self.committed:
                offset, nbytes = self._chunk_span(i)
                self.arena.decommit(offset, nbytes)
                self.committed.discard(i)
                freed += nbytes
        return freed

    @property
    def committed_bytes(self) -> int:
        return sum(self.layout.chunks[i].nbytes for i in self.committed)

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
        self.tp, self.rank, self.group = tp, rank, group
        self._runs, self._views, self._bias_runs = runs, views, bias_runs

    def deactivate(self) -> None:
        """No active shard (standby): every chunk may be released; forward() refuses until set_shard()."""
        self.tp, self.rank, self.group = 1, 0, None
        self._runs, self._views, self._bias_runs = [], [], []

    @property
    def shard_width(self) -> int:
        """Output columns (column mode) or input columns (row mode) of the active shard, padding included."""
        return sum(r.num_rows for r in self._runs)

    # ------------------------------------------------------------------ compute
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._views:
            raise RuntimeError("ShardableLinear has no active shard: call set_shard() after load()")
        if self.mode == "column":
            outs = [fp32_linear(x, w, b) for w, b in zip(self._views, self._bias_runs)]  # [..., run_rows] each
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)          # [..., shard_width]
        if x.shape[-1] != self.shard_width:
            raise ValueError(f"row-parallel input has {x.shape[-1]} columns, shard expects {self.shard_width}")
        y, col = None, 0
        for w in self._views:                                                       # w: [run_rows, out_features]
            part = torch.matmul(x[..., col:col + w.shape[0]], w)                   # [..., out_features]
            y = part if y is None else y.add_(part)
            col += w.shape[0]
        if self.tp > 1:
            import torch.distributed as dist

            dist.all_reduce(y, group=self.group)
        return y if self.bias is None else y.add_(self.bias)

    def extra_repr(self) -> str:
        return (f"{self.mode}, in={self.in_features}, out={self.out_features}, tp={self.tp}, rank={self.rank}, "
                f"chunks={len(self.layout.chunks)}, committed={sorted(self.committed)}")
