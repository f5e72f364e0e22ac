"""CPU PageArena: one anonymous private mapping; madvise(MADV_DONTNEED) really returns pages to the OS."""

from __future__ import annotations

import mmap

import torch

from elastic_hf.memory.arena import PageArena
from elastic_hf.memory.budget import MemoryBudget

# Python's mmap module lacks some Linux constants (3.11 has no MAP_NORESERVE / MADV_POPULATE_WRITE).
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14


class CpuPageArena(PageArena):
    def __init__(self, capacity_bytes: int, budget: MemoryBudget, owner: str, page_size: int | None = None,
                 prefault: bool = False, huge_pages: bool = False) -> None:
        os_page = mmap.PAGESIZE
        page_size = os_page if page_size is None else page_size
        if page_size % os_page:
            raise ValueError(f"page_size {page_size} must be a multiple of the OS page size {os_page}")
        super().__init__(torch.device("cpu"), capacity_bytes, page_size, budget, owner)
        # Prefaulting moves page-fault cost from the first forward to commit time (e.g. for weights).
        self.prefault = prefault
        self._can_populate = True
        # NORESERVE: a reservation larger than RAM + swap must not fail under strict overcommit; the
        # budget, not the kernel, decides how much gets committed.
        self._mmap = mmap.mmap(-1, self.capacity_bytes,
                               flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
        # torch.frombuffer releases its buffer export at once and only keeps a reference to the object it
        # was given. Handing it this memoryview instead of the mmap makes every view hold an export, so
        # mmap.close() refuses (BufferError) to unmap memory under a live tensor instead of segfaulting.
        self._buffer = memoryview(self._mmap)
        if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
            # Transparent huge pages for large read-mostly ranges (weights): 512x fewer page faults on load and
            # fewer TLB misses when every decode step streams all weights. Decommit still works per 4 KiB page
            # (the kernel splits a huge page when part of it is dropped).
            try:
                self._mmap.madvise(mmap.MADV_HUGEPAGE)
            except OSError:
                pass  # THP disabled on this kernel: plain pages work the same, only slower to fault

    def _commit_pages(self, first: int, end: int) -> None:
        # Anonymous memory is already readable (zero pages); committing is bookkeeping unless prefaulting.
        if self.prefault:
            self._populate(first * self.page_size, (end - first) * self.page_size)

    def _decommit_pages(self, first: int, end: int) -> None:
        # MADV_DONTNEED on a private anonymous mapping frees the frames now and refills with zeros later.
        self._mmap.madvise(mmap.MADV_DONTNEED, first * self.page_size, (end - first) * self.page_size)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, numel: int) -> torch.Tensor:
        return torch.frombuffer(self._buffer, dtype=dtype, count=numel, offset=offset).view(shape)

    def _release_reservation(self) -> None:
        mapping, self._mmap, self._buffer = self._mmap, None, None  # drops our own export
        try:
            mapping.close()
        except BufferError:
            # Live views still hold the memoryview. Their pages were already given back by decommit;
            # the (now empty) virtual range is unmapped when the last view is garbage-collected.
            pass

    def _populate(self, start: int, length: int) -> None:
        if self._can_populate:
            try:
                self._mmap.madvise(_MADV_POPULATE_WRITE, start, length)
                return
            except OSError:
                self._can_populate = False  # kernel < 5.14 (EINVAL) or a sandbox that rejects it
        # Touch one byte per OS page: each write faults in a private zero page.
        step = mmap.PAGESIZE
        buffer = self._buffer
        for pos in range(start, start + length, step):
            buffer[pos] = 0
