"""Torch-free KV block allocator with reference counts: the bookkeeping inside an instance's KVManager
(kv/kv_manager.py), which is the only module that creates or changes one. Block ids are slots of the KV arena; the
set of usable slots grows and shrinks when the workers commit or decommit pages (precision morphs, parameter
drops), so the allocator tracks which slots are attached."""
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
        # holders of every block in use (a block is free exactly when it has none); sharing adds holders
        self._refs: dict[int, int] = {}

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

    def ref_count(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks, {len(self._free)} free of {len(self._attached)}")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._refs[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """One more holder of each block (blocks in use only)."""
        idle = [b for b in block_ids if b not in self._refs]
        if idle:
            raise ValueError(f"blocks {idle[:8]} are not in use: only a held block can be shared")
        for block_id in block_ids:
            self._refs[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one holder of each block; a block with none left becomes allocatable."""
        for block_id in block_ids:
            if block_id not in self._attached:
                raise ValueError(f"block {block_id} is not attached to this allocator")
            if block_id not in self._refs:
                raise ValueError(f"block {block_id} is freed twice (it is not in use)")
        released = []
        for block_id in block_ids:
            left = self._refs[block_id] - 1
            if left:
                self._refs[block_id] = left
            else:
                del self._refs[block_id]
                released.append(block_id)
        # Freed blocks go to the front: they are committed and hot in cache, so reuse them first.
        self._free.extendleft(reversed(released))

    def attach(self, block_ids: list[int]) -> None:
        """New slots (pages just committed) become allocatable."""
        for block_id in block_ids:
            if block_id in self._attached:
                raise ValueError(f"block {block_id} is already attached")
        self._attached.update(block_ids)
        self._free.extend(block_ids)

    def detach_from(self, first_id: int) -> list[int]:
        """Remove every slot with an id >= first_id (all must be free); returns their ids."""
        chosen = {b for b in self._attached if b >= first_id}
        live = sorted(b for b in chosen if b in self._refs)
        if live:
            raise ValueError(f"blocks {live[:8]} are in use: only free blocks can be detached")
        self._free = deque(b for b in self._free if b not in chosen)
        self._attached -= chosen
        return sorted(chosen)

    def detach_free(self, num_blocks: int, prefer_high_ids: bool = True) -> list[int]:
        """Remove up to num_blocks free slots (never live ones) and return their ids so their pages can be
        decommitted. High ids first by default, so the arena shrinks from its tail."""
        candidates = sorted(self._free, reverse=prefer_high_ids)[:num_blocks]
        chosen = set(candidates)
        self._free = deque(b for b in self._free if b not in chosen)
        self._attached.difference_update(chosen)
        return candidates
