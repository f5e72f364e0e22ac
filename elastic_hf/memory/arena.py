"""The PageArena contract shared by the CPU (mmap) and CUDA (VMM) backends.

An arena reserves one large virtual range up front and commits or decommits page ranges inside it, so
that tensors keep stable addresses while the physical memory behind them comes and goes. Every
committed byte is charged to the worker's MemoryBudget under the arena's owner tag.
"""

from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod

import torch

from elastic_hf.memory.budget import MemoryBudget
from elastic_hf.units import format_bytes, round_up


class PageArena(ABC):
    device: torch.device
    page_size: int  # bytes; OS page size (or a multiple) on CPU, VMM granularity (or a multiple) on CUDA
    capacity_bytes: int  # reserved virtual range, page-aligned
    owner: str  # ledger tag in the MemoryBudget, e.g. "weights" or "kv"

    def __init__(self, device: torch.device, capacity_bytes: int, page_size: int, budget: MemoryBudget,
                 owner: str) -> None:
        if page_size <= 0 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a positive power of two, got {page_size}")
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if not owner:
            raise ValueError("owner must be a non-empty ledger tag such as 'weights' or 'kv'")
        self.device = device
        self.page_size = page_size
        self.capacity_bytes = round_up(capacity_bytes, page_size)
        self.owner = owner
        self.budget = budget
        self.num_pages = self.capacity_bytes // page_size
        # One byte per page: compact, and slice ops (count, assignment) run in C for whole ranges.
        self._committed = bytearray(self.num_pages)
        self._num_committed_pages = 0
        # Commits come from the decode loop and from the swapper's copy thread at the same time.
        self._lock = threading.RLock()
        self._closed = False

    # ---- public API -------------------------------------------------------------------------------

    def round_up_to_page(self, nbytes: int) -> int:
        return round_up(nbytes, self.page_size)

    @property
    def committed_bytes(self) -> int:
        return self._num_committed_pages * self.page_size

    @property
    def closed(self) -> bool:
        return self._closed

    def is_committed(self, offset: int, nbytes: int) -> bool:
        """True if every page overlapping [offset, offset+nbytes) is committed; empty ranges count."""
        self._check_range(offset, nbytes, "is_committed")
        if nbytes == 0:
            return True
        first, last = offset // self.page_size, (offset + nbytes - 1) // self.page_size
        return self._committed.count(1, first, last + 1) == last + 1 - first

    def commit(self, offset: int, nbytes: int) -> None:
        """Back [offset, offset+nbytes) with physical pages; pages already committed are free of charge."""
        with self._lock:
            self._check_open()
            first, end = self._page_span(offset, nbytes, "commit")
            new_pages = _uncommitted_runs(self._committed, first, end)
            num_new = sum(e - s for s, e in new_pages)
            if num_new == 0:
                return
            self.budget.charge(self.owner, num_new * self.page_size)
            done: list[tuple[int, int]] = []
            try:
                for s, e in new_pages:
                    self._commit_pages(s, e)
                    done.append((s, e))
                    self._committed[s:e] = b"\x01" * (e - s)
                    self._num_committed_pages += e - s
            except BaseException:
                # Leave the arena and the ledger exactly as before the call.
                for s, e in done:
                    self._decommit_pages(s, e)
                    self._committed[s:e] = bytes(e - s)
                    self._num_committed_pages -= e - s
                self.budget.release(self.owner, num_new * self.page_size)
                raise

    def decommit(self, offset: int, nbytes: int) -> None:
        """Give the physical pages of [offset, offset+nbytes) back; they read as zero once recommitted."""
        with self._lock:
            self._check_open()
            first, end = self._page_span(offset, nbytes, "decommit")
            runs = page_runs(self._committed, first, end)
            num_pages = sum(e - s for s, e in runs)
            for s, e in runs:
                self._decommit_pages(s, e)
                self._committed[s:e] = bytes(e - s)
            self._num_committed_pages -= num_pages
            if num_pages:
                self.budget.release(self.owner, num_pages * self.page_size)

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
             require_committed: bool = True) -> torch.Tensor:
        """Zero-copy tensor over [offset, offset+numel*itemsize); the bytes must lie in committed pages unless
        require_committed=False (a whole-range view, e.g. the KV pool's, whose owner touches only the pages it
        committed)."""
        self._check_open()
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise ValueError(f"view shape must have non-negative sizes, got {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        if offset % itemsize:
            raise ValueError(f"view offset {offset} is not aligned to the {itemsize}-byte itemsize of {dtype}")
        numel = math.prod(shape)
        nbytes = numel * itemsize
        self._check_range(offset, nbytes, "view")
        if require_committed and not self.is_committed(offset, nbytes):
            raise ValueError(f"view of {nbytes} bytes at offset {offset} touches uncommitted pages "
                             f"(page size {self.page_size}, {self.committed_bytes} of "
                             f"{self.capacity_bytes} bytes committed in the {self.owner!r} arena)")
        if numel == 0:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return self._view(offset, shape, dtype, numel)

    def close(self) -> None:
        """Release every page and the reserved range; views must not be used afterwards."""
        with self._lock:
            if self._closed:
                return
            if self._num_committed_pages:
                self.decommit(0, self.capacity_bytes)
            self._closed = True
            self._release_reservation()

    def __enter__(self) -> "PageArena":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(device={self.device}, owner={self.owner!r}, "
                f"committed={format_bytes(self.committed_bytes)} of {format_bytes(self.capacity_bytes)}, "
                f"page_size={self.page_size})")

    # ---- backend hooks (page indices, [start, end)) ----------------------------------------------

    @abstractmethod
    def _commit_pages(self, first: int, end: int) -> None: ...

    @abstractmethod
    def _decommit_pages(self, first: int, end: int) -> None: ...

    @abstractmethod
    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, numel: int) -> torch.Tensor: ...

    @abstractmethod
    def _release_reservation(self) -> None: ...

    # ---- helpers ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"the {self.owner!r} arena on {self.device} is closed")

    def _check_range(self, offset: int, nbytes: int, what: str) -> None:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"{what} needs offset >= 0 and nbytes >= 0, got offset {offset}, nbytes {nbytes}")
        if offset + nbytes > self.capacity_bytes:
            raise ValueError(f"{what} of {nbytes} bytes at offset {offset} exceeds capacity {self.capacity_bytes}")

    def _page_span(self, offset: int, nbytes: int, what: str) -> tuple[int, int]:
        self._check_range(offset, nbytes, what)
        # Strict alignment: rounding a decommit outwards would silently free a neighbour's bytes.
        if offset % self.page_size or nbytes % self.page_size:
            raise ValueError(f"{what} range must be page-aligned: offset {offset}, nbytes {nbytes}, "
                             f"page size {self.page_size} (use round_up_to_page)")
        return offset // self.page_size, (offset + nbytes) // self.page_size


def round_up_to_page(nbytes: int, page_size: int) -> int:
    """Smallest multiple of page_size that holds nbytes."""
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    return round_up(nbytes, page_size)


def _runs(bitmap: bytearray, first: int, end: int, value: int) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of pages equal to value; bytearray.find keeps this in C per run."""
    other = 1 - value
    runs = []
    pos = first
    while pos < end:
        start = bitmap.find(value, pos, end)
        if start < 0:
            break
        stop = bitmap.find(other, start, end)
        stop = end if stop < 0 else stop
        runs.append((start, stop))
        pos = stop
    return runs


def _uncommitted_runs(bitmap: bytearray, first: int, end: int) -> list[tuple[int, int]]:
    return _runs(bitmap, first, end, 0)


def page_runs(bitmap: bytearray, first: int, end: int) -> list[tuple[int, int]]:
    """Maximal [start, end) runs of nonzero (1) bytes of a page bitmap within [first, end)."""
    return _runs(bitmap, first, end, 1)
