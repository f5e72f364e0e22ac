"""Torch-free KV block allocator. Block ids are slots of the KV arena; the set of usable slots grows and shrinks
when a precision morph attaches or detaches pages, so the allocator tracks which slots are attached."""
from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, block_ids: list[int] | range = ()):
        self._free: deque[int] = deque(block_ids)
        self._attached: set[int] = set(self._free)
        if len(self._attached) != len(self._free):
            raise ValueError("block ids must be unique")

    @property
    def num_total(self) -> int:
        return len(self._attached)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._attached) - len(self._free)

    def is_attached(self, block_id: int) -> bool:
        return block_id in self._attached

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks, {len(self._free)} free of {len(self._attached)}")
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id not in self._attached:
                raise ValueError(f"block {block_id} is not attached to this allocator")
        # Freed blocks go to the front: they are committed and hot in cache, so reuse them first.
        self._free.extendleft(reversed(block_ids))

    def attach(self, block_ids: list[int]) -> None:
        """New slots (pages just committed) become allocatable."""
        for block_id in block_ids:
            if block_id in self._attached:
                raise ValueError(f"block {block_id} is already attached")
        self._attached.update(block_ids)
        self._free.extend(block_ids)

    def detach_free(self, num_blocks: int, prefer_high_ids: bool = True) -> list[int]:
        """Remove up to num_blocks free slots (never live ones) and return their ids so their pages can be
        decommitted. High ids first by default, so the arena shrinks from its tail."""
        candidates = sorted(self._free, reverse=prefer_high_ids)[:num_blocks]
        chosen = set(candidates)
        self._free = deque(b for b in self._free if b not in chosen)
        self._attached.difference_update(chosen)
        return candidates
