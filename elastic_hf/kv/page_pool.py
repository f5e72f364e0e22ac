"""KV pages in an arena. The arena reserves room for `max_blocks` blocks; only attached blocks are committed.
Precision morphs attach (commit) and detach (decommit) blocks while requests run."""
from __future__ import annotations

import torch

from elastic_hf.kv.block_allocator import BlockAllocator
from elastic_hf.kv.layout import KVLayout
from elastic_hf.memory.arena import PageArena


class KVPagePool:
    def __init__(self, layout: KVLayout, arena: PageArena, max_blocks: int, num_initial_blocks: int):
        if num_initial_blocks > max_blocks:
            raise ValueError(f"num_initial_blocks={num_initial_blocks} exceeds max_blocks={max_blocks}")
        if max_blocks * layout.block_bytes > arena.capacity_bytes:
            raise ValueError(f"{max_blocks} blocks of {layout.block_bytes} bytes exceed the arena's "
                             f"{arena.capacity_bytes} bytes")
        self.layout = layout
        self.arena = arena
        self.max_blocks = max_blocks
        self.allocator = BlockAllocator()
        # [max_blocks, block_numel]: the whole reserved range; only attached rows are ever touched.
        self._base = arena.view(0, (max_blocks, layout.block_numel), layout.dtype, require_committed=False)
        self._layer_views = [self._layer_view(i) for i in range(layout.num_layers)]
        # [max_blocks * rows_per_block, head_dim]: every (block, layer, head, K/V, token) is one row, so writes and
        # gathers are single index_copy_/index_select calls with precomputed row ids.
        self.rows = self._base.view(max_blocks * layout.rows_per_block, layout.head_dim)
        # [max_blocks * chunks_per_block, block_size, head_dim]: the same memory as whole K or V slabs of a block,
        # so a decode gathers a sequence's context with one index per block instead of one per token.
        self.chunks = self._base.view(max_blocks * layout.chunks_per_block, layout.block_size, layout.head_dim)
        self.attach_blocks(num_initial_blocks)

    def _layer_view(self, layer_idx: int) -> torch.Tensor:
        lo = self.layout
        start = layer_idx * lo.layer_numel
        # [max_blocks, num_kv_heads, 2, block_size, head_dim], block stride = one whole arena block
        return self._base[:, start:start + lo.layer_numel].view(
            self.max_blocks, lo.num_kv_heads, 2, lo.block_size, lo.head_dim)

    def layer(self, layer_idx: int) -> torch.Tensor:
        return self._layer_views[layer_idx]

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_total

    @property
    def committed_bytes(self) -> int:
        return self.num_blocks * self.layout.block_bytes

    def attach_blocks(self, num_blocks: int) -> list[int]:
        """Commit `num_blocks` unattached slots (lowest ids first) and make them allocatable."""
        attached = self.allocator._attached
        slots = [b for b in range(self.max_blocks) if b not in attached][:num_blocks]
        if len(slots) < num_blocks:
            raise ValueError(f"cannot attach {num_blocks} blocks: {self.max_blocks - len(attached)} slots left "
                             f"of {self.max_blocks}")
        committed: list[int] = []
        try:
            for block_id in slots:
                self.arena.commit(block_id * self.layout.block_bytes, self.layout.block_bytes)
                committed.append(block_id)
        finally:
            self.allocator.attach(committed)
        return committed

    def detach_blocks(self, num_blocks: int) -> list[int]:
        """Decommit up to `num_blocks` free blocks (never live ones); returns the detached ids."""
        block_ids = self.allocator.detach_free(num_blocks)
        for block_id in block_ids:
            self.arena.decommit(block_id * self.layout.block_bytes, self.layout.block_bytes)
        return block_ids
