"""KV pages in an arena (the data plane's side of the KV cache). The arena reserves room for `max_blocks` blocks;
only attached blocks are committed. Which blocks hold which sequence is the control plane's business (its
KVManager mirrors the attached ids); precision morphs attach (commit) and detach (decommit) blocks while
requests run."""
from __future__ import annotations

import torch

from elastic_hf.kv.kv_manager import KVResize
from elastic_hf.kv.layout import KVLayout
from elastic_hf.memory.arena import PageArena, page_runs


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
        self._attached: set[int] = set()
        self._prefix: bool | None = True    # attached == {0 .. n-1}; None: not known since the last change
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
        """[max_blocks, kv_heads, 2, block_size, head_dim] view of model layer `layer_idx`."""
        return self._layer_views[self.layout.local_layer(layer_idx)]

    @property
    def num_blocks(self) -> int:
        return len(self._attached)

    def attached_ids(self) -> list[int]:
        return sorted(self._attached)

    def is_attached(self, block_id: int) -> bool:
        return block_id in self._attached

    @property
    def committed_bytes(self) -> int:
        return self.arena.committed_bytes

    # Blocks smaller than a page share pages with their neighbours (KVLayout.block_bytes): a page is committed
    # while any attached block touches it, and decommitted once none does.
    def _commit_block(self, block_id: int) -> None:
        first, end = self.layout.page_span(block_id)
        page = self.arena.page_size
        self.arena.commit(first * page, (end - first) * page)   # pages a neighbour committed cost nothing

    def _page_runs_only_of(self, block_ids, keep) -> list[tuple[int, int]]:
        """Runs [start, end) of the pages that blocks `block_ids` touch and no block for which keep(block) is true
        touches. A block of at least a page shares only the first and last page of its span, so only those are
        checked against their neighbours: a trim of a mostly free 1 GiB pool is a few thousand checks and a few
        decommit calls, not one per 4 KiB page (which took 1.4 s)."""
        layout, bb, page = self.layout, self.layout.block_bytes, self.arena.page_size
        ids = sorted(set(block_ids))
        if not ids:
            return []
        marked = bytearray(layout.page_span(self.max_blocks - 1)[1])   # 1: a page to decommit
        shared: set[int] = set()
        for b in ids:
            first, end = layout.page_span(b)
            marked[first:end] = b"\x01" * (end - first)
            shared.update((first, end - 1) if bb >= page else range(first, end))
        for p in shared:
            if any(keep(b) for b in range(p * page // bb, min(((p + 1) * page - 1) // bb + 1, self.max_blocks))):
                marked[p] = 0
        return page_runs(marked, 0, len(marked))

    def _decommit_runs(self, runs: list[tuple[int, int]]) -> None:
        page = self.arena.page_size
        for start, end in runs:
            self.arena.decommit(start * page, (end - start) * page)

    def attach_blocks(self, num_blocks: int, commit: bool = True) -> list[int]:
        """Commit `num_blocks` unattached slots (lowest ids first); returns their ids for the control plane's
        allocator. commit=False: attach them without their pages, which `commit_blocks` commits before anything is
        written there (a KV exchange's destination blocks, committed chunk by chunk as the old pool gives pages
        back: kv/exchange_schedule.py)."""
        slots = [b for b in range(self.max_blocks) if b not in self._attached][:num_blocks]
        if len(slots) < num_blocks:
            raise ValueError(f"cannot attach {num_blocks} blocks: {self.max_blocks - len(self._attached)} slots "
                             f"left of {self.max_blocks}")
        committed: list[int] = []
        try:
            for block_id in slots:
                if commit:
                    self._commit_block(block_id)
                committed.append(block_id)
        finally:
            self._attached.update(committed)
            self._prefix = None
        return committed

    def commit_blocks(self, block_ids) -> None:
        """Commit the pages of attached blocks (those attach_blocks(commit=False) left without; pages already
        committed cost nothing)."""
        unknown = [b for b in block_ids if b not in self._attached]
        if unknown:
            raise ValueError(f"blocks {unknown[:8]} are not attached ({len(self._attached)} attached)")
        for block_id in block_ids:
            self._commit_block(block_id)

    def attachable_within(self, nbytes: int) -> int:
        """How many blocks attach_blocks could attach with `nbytes` of budget: the lowest free slots, counting only
        the pages they would newly commit."""
        layout, attached, page = self.layout, len(self._attached), self.arena.page_size
        budget_pages = max(nbytes, 0) // page
        if layout.block_bytes % page == 0:      # blocks of whole pages: no sharing to count
            return min(self.max_blocks - attached, budget_pages * page // layout.block_bytes)
        if attached == 0 or (attached - 1 in self._attached and self._is_prefix()):
            # blocks 0 .. n-1 (pools grow and shrink at their tail): whole pages from the start, in O(1)
            within = layout.blocks_within(layout.bytes_for_blocks(attached) + budget_pages * page)
            return min(self.max_blocks, within) - attached
        new_pages: set[int] = set()
        count = 0
        for block_id in range(self.max_blocks):
            if block_id in self._attached:
                continue
            fresh = {p for p in range(*layout.page_span(block_id))
                     if p not in new_pages and not self.arena.is_committed(p * page, page)}
            if len(new_pages) + len(fresh) > budget_pages:
                break
            new_pages |= fresh
            count += 1
        return count

    def _is_prefix(self) -> bool:
        """Whether the attached blocks are exactly 0 .. n-1 (cached until the next attach or detach)."""
        if self._prefix is None:
            self._prefix = max(self._attached, default=-1) == len(self._attached) - 1
        return self._prefix

    def detach_blocks(self, block_ids: list[int]) -> None:
        """Decommit blocks the control plane detached from its allocator (free ones only: their pages go back to
        the budget, and with them whatever they held; a page an attached neighbour shares stays)."""
        unknown = [b for b in block_ids if b not in self._attached]
        if unknown:
            raise ValueError(f"blocks {unknown[:8]} are not attached ({len(self._attached)} attached)")
        self._attached.difference_update(block_ids)
        self._prefix = None
        self._decommit_runs(self._page_runs_only_of(block_ids, self._attached.__contains__))

    def trim_to(self, live: set[int]) -> list[int]:
        """Decommit the pages of every attached block not in `live` that no live block shares, leaving them
        attached (a reshape's rollback recommits them with recommit); returns the trimmed block ids."""
        trimmed = [b for b in sorted(self._attached) if b not in live]
        self._decommit_runs(self._page_runs_only_of(trimmed, live.__contains__))
        return trimmed

    def recommit(self, block_ids: list[int]) -> None:
        """Commit trimmed blocks again (they were free: zero pages are fine)."""
        for block_id in block_ids:
            self._commit_block(block_id)

    def resize(self, resize: KVResize) -> list[int]:
        """Apply a KV manager's resize (kv/kv_manager.py): decommit the given free blocks, commit `attach` more
        (lowest free slots), or hold exactly blocks 0 .. reset_to - 1. Returns the newly attached ids."""
        if resize.detach_block_ids:
            self.detach_blocks(resize.detach_block_ids)
        attach = resize.attach
        if resize.reset_to is not None:
            if resize.reset_to > self.max_blocks:
                raise ValueError(f"cannot hold {resize.reset_to} blocks: the pool reserves {self.max_blocks}")
            beyond = [b for b in self._attached if b >= resize.reset_to]
            if beyond:
                self.detach_blocks(sorted(beyond))
            attach += resize.reset_to - len(self._attached)   # the lowest free slots are the missing ones below it
        return self.attach_blocks(attach) if attach > 0 else []
