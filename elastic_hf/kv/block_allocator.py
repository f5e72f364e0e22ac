"""Torch-free KV block allocator with reference counts: the bookkeeping inside an instance's KVManager
(kv/kv_manager.py), which is the only module that creates or changes one. Block ids are slots of the KV arena; the
set of usable slots grows and shrinks when the workers commit or decommit pages (precision morphs, parameter
drops), so the allocator tracks which slots are attached."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable


class NoFreeBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, block_ids: list[int] | range = ()):
        self._free: deque[int] = deque(block_ids)
        self._attached: set[int] = set(self._free)
        if len(self._attached) != len(self._free):
            raise ValueError("block ids must be unique")
        # Free blocks whose KV a prefix cache still names (kv/prefix_cache.py), least recently freed first:
        # allocatable, but only after every other free block, and a lookup can take one back (`acquire`).
        self._cached_free: dict[int, None] = {}
        # holders of every block in use (a block is free exactly when it has none); sharing adds holders
        self._refs: dict[int, int] = {}

    @property
    def num_total(self) -> int:
        return len(self._attached)

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    def is_attached(self, block_id: int) -> bool:
        return block_id in self._attached

    def ref_count(self, block_id: int) -> int:
        return self._refs.get(block_id, 0)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """Blocks that cache nothing first, then cached ones, least recently freed first (the caller evicts their
        hashes: they are about to be overwritten)."""
        if num_blocks > self.num_free:
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks, {self.num_free} free of {len(self._attached)}")
        block_ids = [self._free.popleft() for _ in range(min(num_blocks, len(self._free)))]
        while len(block_ids) < num_blocks:
            block_id = next(iter(self._cached_free))
            del self._cached_free[block_id]
            block_ids.append(block_id)
        for block_id in block_ids:
            self._refs[block_id] = 1
        return block_ids

    def acquire(self, block_ids: list[int]) -> None:
        """One more holder of each block, in use or cached free (a prefix-cache hit takes it back)."""
        for block_id in block_ids:
            if block_id not in self._refs and block_id not in self._cached_free:
                raise ValueError(f"block {block_id} is neither in use nor cached")
        for block_id in block_ids:
            if block_id in self._refs:
                self._refs[block_id] += 1
            else:
                del self._cached_free[block_id]
                self._refs[block_id] = 1

    def uncache_all(self) -> None:
        """The prefix cache forgot every block: cached free blocks become plain free blocks."""
        self._free.extend(self._cached_free)
        self._cached_free.clear()

    def share(self, block_ids: list[int]) -> None:
        """One more holder of each block (blocks in use only)."""
        idle = [b for b in block_ids if b not in self._refs]
        if idle:
            raise ValueError(f"blocks {idle[:8]} are not in use: only a held block can be shared")
        for block_id in block_ids:
            self._refs[block_id] += 1

    def free(self, block_ids: list[int], cached: Callable[[int], bool] | None = None) -> None:
        """Drop one holder of each block; a block with none left becomes allocatable (last in line when
        `cached(block)` says a prefix cache names it)."""
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
                if cached is not None and cached(block_id):
                    self._cached_free[block_id] = None
                else:
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
        self._remove_free(chosen)
        return sorted(chosen)

    def detach_free(self, num_blocks: int, prefer_high_ids: bool = True) -> list[int]:
        """Remove up to num_blocks free slots (never live ones) and return their ids so their pages can be
        decommitted: blocks that cache nothing first (high ids first by default, so the arena shrinks from its
        tail), then cached ones, least recently freed first."""
        candidates = sorted(self._free, reverse=prefer_high_ids)[:num_blocks]
        candidates += list(self._cached_free)[:num_blocks - len(candidates)]
        self._remove_free(set(candidates))
        return candidates

    def _remove_free(self, chosen: set[int]) -> None:
        self._free = deque(b for b in self._free if b not in chosen)
        for block_id in chosen:
            self._cached_free.pop(block_id, None)
        self._attached -= chosen
