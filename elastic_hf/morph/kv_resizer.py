"""KVResizer (MorphServe §4.4): turns budget bytes that weights gave up into KV blocks, and gives blocks back
when a restore needs the bytes. Only free blocks are ever detached; a live block is never touched.

A headroom (the largest quant slot) stays uncommitted at all times, so a swap to a quantized variant can commit
its slot before the layer's fp region is released, even when every KV block is in use: the moment MorphServe
needs to morph is exactly when the KV cache is full."""
from __future__ import annotations

from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.memory.budget import MemoryBudget


class KVResizer:
    def __init__(self, pool: KVPagePool, budget: MemoryBudget, headroom_bytes: int):
        if headroom_bytes < 0:
            raise ValueError(f"headroom_bytes must be >= 0, got {headroom_bytes}")
        self.pool = pool
        self.budget = budget
        self.headroom_bytes = headroom_bytes
        self.num_attached = 0   # blocks attached / detached by morphs (cumulative)
        self.num_detached = 0

    @property
    def block_bytes(self) -> int:
        return self.pool.layout.block_bytes

    def spare_blocks(self) -> int:
        """Blocks the budget could take now while keeping the headroom free."""
        slots_left = self.pool.max_blocks - self.pool.num_blocks
        return max(0, min(slots_left, (self.budget.free_bytes - self.headroom_bytes) // self.block_bytes))

    def grow(self) -> int:
        """Attach every block the budget allows beyond the headroom; returns how many."""
        num = self.spare_blocks()
        if num:
            self.pool.attach_blocks(num)
            self.num_attached += num
        return num

    def blocks_to_free(self, nbytes: int, keep_headroom: bool) -> int:
        """Blocks that must be detached so that nbytes can be committed (with the headroom still free after it
        when keep_headroom: a restore must not use up the room the next morph needs)."""
        missing = nbytes + (self.headroom_bytes if keep_headroom else 0) - self.budget.free_bytes
        return max(0, -(-missing // self.block_bytes))

    def make_room(self, nbytes: int, keep_headroom: bool = True) -> bool:
        """Detach free blocks until nbytes (+ headroom) are uncommitted. All or nothing: if the free blocks do not
        suffice, nothing is detached (shrinking the cache for a swap that cannot start yet only hurts)."""
        needed = self.blocks_to_free(nbytes, keep_headroom)
        if needed == 0:
            return True
        if self.pool.allocator.num_free < needed:
            return False
        detached = self.pool.detach_blocks(needed)
        self.num_detached += len(detached)
        return len(detached) == needed
