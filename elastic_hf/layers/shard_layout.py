"""Which rows of which tensor each tensor-parallel rank owns, and the padded layout that lets a worker switch TP
degree by decommitting pages instead of copying weights (Gyges §4.2, AMOEBA §3.2 eq. 1-2).

A sharded tensor is split along `units` (KV heads with their query groups for attention, intermediate neurons for
the MLP). Every TP degree that the deployment may use cuts the units at known boundaries; the union of these
boundaries splits the tensor into chunks. Each chunk starts on a page boundary of the weights arena, so the shard of
any (degree, rank) is a run of whole chunks and the pages of the other chunks can be released in place.

MLP chunks are padded with whole zero rows (`zero_pad=True`) where they cost less than a page:
gate/up produce zero columns there and down_proj multiplies them by zero rows, so one GEMM over the padded shard gives
the unpadded result (eq. 2). Elsewhere (attention chunks cannot carry zero heads; rows that do not divide a 2 MiB
page) the padding is a byte gap, and the forward runs one GEMM per gap-free run of chunks.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastic_hf.units import round_up


def split_units(num_units: int, tp: int) -> list[tuple[int, int]]:
    """[start, end) unit ranges of the `tp` ranks; uneven when tp does not divide num_units (the first ranks get
    one more: 3 KV heads at TP2 -> (0, 2), (2, 3))."""
    if not 1 <= tp <= num_units:
        raise ValueError(f"tp must be in [1, {num_units}] to split {num_units} units, got {tp}")
    base, extra = divmod(num_units, tp)
    ranges, start = [], 0
    for rank in range(tp):
        end = start + base + (rank < extra)
        ranges.append((start, end))
        start = end
    return ranges


def allowed_tp_degrees(num_workers: int, num_kv_heads: int) -> tuple[int, ...]:
    """Powers of two up to the worker count that leave every rank at least one KV head."""
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    degrees, d = [], 1
    while d <= num_workers and d <= num_kv_heads:
        degrees.append(d)
        d *= 2
    return tuple(degrees)


@dataclass(frozen=True, slots=True)
class Chunk:
    unit_start: int
    unit_end: int
    byte_offset: int     # from the tensor's base in the arena; page-aligned
    num_rows: int        # payload rows
    stored_rows: int     # payload + zero-pad rows (== num_rows without zero padding)
    nbytes: int          # committed bytes, whole pages


@dataclass(frozen=True, slots=True)
class Run:
    """Consecutive chunks with no gap between them: one contiguous [rows, row_numel] view."""
    byte_offset: int
    num_rows: int        # rows a GEMM sees (pads included under zero padding)
    unit_start: int
    unit_end: int


@dataclass(slots=True)
class PaddedLayout:
    """Storage of one sharded weight as [rows, row_numel]; rows = units * unit_rows (+ padding)."""
    num_units: int
    unit_rows: int
    row_numel: int
    itemsize: int
    page_size: int
    degrees: tuple[int, ...]
    zero_pad: bool
    chunks: list[Chunk] = field(init=False)

    def __post_init__(self):
        for name in ("num_units", "unit_rows", "row_numel", "itemsize", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.degrees or any(d < 1 or d > self.num_units for d in self.degrees):
            raise ValueError(f"degrees must be in [1, {self.num_units}], got {self.degrees}")
        bounds = sorted({b for d in self.degrees for r in split_units(self.num_units, d) for b in r})
        row_bytes = self.row_bytes
        rows_align = math.lcm(self.page_size, row_bytes) // row_bytes  # rows that fill whole pages
        self.chunks = []
        offset = 0
        for start, end in zip(bounds, bounds[1:]):
            rows = (end - start) * self.unit_rows
            nbytes = round_up(rows * row_bytes, self.page_size)
            stored = rows
            # Zero rows only where they fit the chunk's last page anyway: with 2 MiB pages and rows that do not
            # divide them, whole-row padding would cost many pages, and a gap (an extra GEMM) is cheaper.
            padded = round_up(rows, rows_align)
            if self.zero_pad and (padded - rows) * row_bytes < self.page_size:
                stored = padded
                nbytes = padded * row_bytes
            self.chunks.append(Chunk(start, end, offset, rows, stored, nbytes))
            offset += nbytes

    @property
    def row_bytes(self) -> int:
        return self.row_numel * self.itemsize

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    @property
    def payload_bytes(self) -> int:
        return self.num_units * self.unit_rows * self.row_bytes

    def shard_chunks(self, tp: int, rank: int) -> list[int]:
        """Indices of the chunks that (tp, rank) owns."""
        if tp not in self.degrees:
            raise ValueError(f"tp={tp} is not an allowed degree of this layout {self.degrees}")
        if not 0 <= rank < tp:
            raise ValueError(f"rank must be in [0, {tp}), got {rank}")
        start, end = split_units(self.num_units, tp)[rank]
        return [i for i, c in enumerate(self.chunks) if start <= c.unit_start and c.unit_end <= end]

    def runs(self, chunk_ids: list[int]) -> list[Run]:
        runs: list[Run] = []
        for i in chunk_ids:
            c = self.chunks[i]
            last = runs[-1] if runs else None
            if last is not None and last.unit_end == c.unit_start and \
                    last.byte_offset + last.num_rows * self.row_bytes == c.byte_offset:
                runs[-1] = Run(last.byte_offset, last.num_rows + c.stored_rows, last.unit_start, c.unit_end)
            else:
                runs.append(Run(c.byte_offset, c.stored_rows, c.unit_start, c.unit_end))
        return runs


@dataclass(frozen=True, slots=True)
class ModelShardSpec:
    """Shapes that decide every layer's sharding (the same in all decoder layers)."""
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    page_size: int
    degrees: tuple[int, ...]

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        bad = [d for d in self.degrees if d > self.num_kv_heads or d > self.intermediate_size]
        if bad:
            raise ValueError(f"TP degrees {bad} exceed num_kv_heads={self.num_kv_heads}: every rank needs a KV head")

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layout(self, kind: str) -> PaddedLayout:
        """kind: q, k, v (column, by KV head), o (row, stored transposed), gate, up (column), down (row, stored
        transposed)."""
        hd, g = self.head_dim, self.group
        common = dict(itemsize=self.itemsize, page_size=self.page_size, degrees=self.degrees)
        if kind == "q":
            return PaddedLayout(self.num_kv_heads, g * hd, self.hidden_size, zero_pad=False, **common)
        if kind in ("k", "v"):
            return PaddedLayout(self.num_kv_heads, hd, self.hidden_size, zero_pad=False, **common)
        if kind == "o":
            return PaddedLayout(self.num_kv_heads, g * hd, self.hidden_size, zero_pad=False, **common)
        if kind in ("gate", "up", "down"):
            return PaddedLayout(self.intermediate_size, 1, self.hidden_size, zero_pad=True, **common)
        raise ValueError(f"unknown sharded weight kind {kind!r}; expected one of q k v o gate up down")


SHARDED_KINDS = ("q", "k", "v", "o", "gate", "up", "down")
COLUMN_KINDS = ("q", "k", "v", "gate", "up")


def padding_overhead(spec: ModelShardSpec, num_layers: int) -> dict:
    """Bytes the padded layout costs over the unpadded, page-rounded TP1 layout of the same tensors."""
    padded = unpadded = payload = 0
    for kind in SHARDED_KINDS:
        lay = spec.layout(kind)
        padded += lay.nbytes
        unpadded += round_up(lay.payload_bytes, spec.page_size)
        payload += lay.payload_bytes
    padded, unpadded, payload = padded * num_layers, unpadded * num_layers, payload * num_layers
    return {"degrees": list(spec.degrees), "page_size": spec.page_size, "payload_bytes": payload,
            "unpadded_bytes": unpadded, "padded_bytes": padded, "overhead_bytes": padded - unpadded,
            "overhead_fraction": (padded - unpadded) / payload, "padded_over_payload": padded / payload}
