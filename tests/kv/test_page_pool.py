"""KV blocks smaller than an arena page share pages (a 2 MiB CUDA page holds ~5.7 blocks of the default model): a
page is committed while any attached block touches it and given back when none does; the ledger counts pages, not
blocks x page. Run on the CPU arena with 64 KiB pages and 24 KiB blocks (2.67 blocks a page)."""
import pytest
import torch

from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.memory import MemoryBudget, create_arena
from elastic_hf.memory.budget import MemoryBudgetExceeded

PAGE = 64 << 10
# 3 layers x 1 KV head x K/V x 16 tokens x 64 dims x 4 bytes = 24 KiB
LAYOUT = KVLayout(num_layers=3, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, page_size=PAGE)


def _pool(num_blocks: int, max_blocks: int = 32, budget_bytes: int = 1 << 30) -> KVPagePool:
    budget = MemoryBudget(budget_bytes)
    arena = create_arena("cpu", max_blocks * LAYOUT.block_bytes, budget, "kv", page_size=PAGE)
    return KVPagePool(LAYOUT, arena, max_blocks, num_blocks)


def _fill(pool, block_id, value):
    pool.layer(0)[block_id].fill_(value)
    pool.layer(2)[block_id].fill_(value)


def _holds(pool, block_id, value) -> bool:
    return bool((pool.layer(0)[block_id] == value).all() and (pool.layer(2)[block_id] == value).all())


def test_blocks_are_not_padded_to_pages():
    assert LAYOUT.block_bytes == 24 << 10 == LAYOUT.block_payload_bytes
    assert LAYOUT.page_span(0) == (0, 1) and LAYOUT.page_span(2) == (0, 2) and LAYOUT.page_span(8) == (3, 4)
    assert LAYOUT.blocks_within(PAGE * 3 + 100) == 8 and LAYOUT.bytes_for_blocks(8) == 3 * PAGE


def test_attached_blocks_commit_the_pages_they_touch_once():
    pool = _pool(10)
    assert pool.committed_bytes == pool.arena.budget.used_bytes("kv") == 4 * PAGE   # 240 KiB -> 4 pages, not 10
    for b in range(10):
        _fill(pool, b, b + 1)
    assert all(_holds(pool, b, b + 1) for b in range(10))


def test_detach_gives_back_only_pages_no_attached_block_touches():
    pool = _pool(10)
    for b in range(10):
        _fill(pool, b, b + 1)
    pool.detach_blocks([9, 8])          # page 3 (192-256 KiB) holds blocks 8 and 9 alone (7 ends at 192 KiB)
    assert pool.committed_bytes == 3 * PAGE and pool.num_blocks == 8
    pool.detach_blocks([4])             # page 1 (64-128 KiB) is shared with blocks 2, 3 and 5: nothing freed
    assert pool.committed_bytes == 3 * PAGE
    assert all(_holds(pool, b, b + 1) for b in (0, 1, 2, 3, 5, 6, 7))   # the neighbours' data stayed
    pool.detach_blocks([3, 5])          # page 1 still holds block 2's tail, page 2 blocks 6 and 7
    assert pool.committed_bytes == 3 * PAGE
    pool.detach_blocks([2])
    assert pool.committed_bytes == 2 * PAGE and all(_holds(pool, b, b + 1) for b in (0, 1, 6, 7))
    assert pool.attach_blocks(3) == [2, 3, 4] and pool.committed_bytes == 3 * PAGE
    assert (pool.layer(1)[3] == 0).all()   # a recommitted page reads zero


def test_attachable_within_counts_the_pages_blocks_would_add():
    pool = _pool(4, budget_bytes=4 * PAGE)   # 4 blocks: 96 KiB -> 2 pages, 2 pages free
    free = pool.arena.budget.free_bytes
    assert free == 2 * PAGE
    n = pool.attachable_within(free)
    assert n == 10 - 4                      # blocks 4..9 end at 240 KiB: pages 1 (shared), 2 and 3
    pool.attach_blocks(n)
    assert pool.arena.budget.free_bytes == 0
    assert pool.attachable_within(0) == 0
    with pytest.raises(MemoryBudgetExceeded):
        pool.attach_blocks(1)
    assert pool.num_blocks == 10            # the failed attach left the pool as it was


def test_trim_keeps_pages_of_live_blocks_and_recommit_restores():
    pool = _pool(10)
    for b in range(10):
        _fill(pool, b, b + 1)
    trimmed = pool.trim_to({1, 7})
    assert trimmed == [0, 2, 3, 4, 5, 6, 8, 9] and pool.num_blocks == 10
    assert pool.committed_bytes == 2 * PAGE   # page 0 (block 1) and page 2 (block 7 spans 168-192 KiB)
    assert _holds(pool, 1, 2) and _holds(pool, 7, 8)
    pool.recommit(trimmed)
    assert pool.committed_bytes == 4 * PAGE and _holds(pool, 7, 8)


def test_a_hole_left_by_a_detached_block_costs_nothing_to_fill():
    pool = _pool(10)
    pool.detach_blocks([1])                 # page 0 stays: blocks 0 and 2 touch it
    assert pool.committed_bytes == 4 * PAGE
    assert pool.attachable_within(0) == 1   # block 1 again, on its committed page; block 10 would need page 4
    assert pool.attachable_within(PAGE) == 1 + 3   # and blocks 10-12 (240-312 KiB), whose new page is page 4
    assert pool.attach_blocks(1) == [1] and pool.committed_bytes == 4 * PAGE


def test_trim_of_blocks_larger_than_a_page_decommits_in_runs(monkeypatch):
    """Blocks of 1.5 pages (the CPU case: 4 KiB pages, blocks of hundreds of KiB): only the pages at a live
    block's ends are shared, and a trim gives back each free stretch in one decommit call, not page by page."""
    page = 16 << 10
    layout = KVLayout(num_layers=3, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, page_size=page)
    budget = MemoryBudget(1 << 30)
    pool = KVPagePool(layout, create_arena("cpu", 64 * layout.block_bytes, budget, "kv", page_size=page), 64, 64)
    for b in (5, 40):
        _fill(pool, b, b + 1)
    calls = []
    decommit = pool.arena.decommit
    monkeypatch.setattr(pool.arena, "decommit", lambda offset, nbytes: calls.append(nbytes) or decommit(offset,
                                                                                                       nbytes))
    pool.trim_to({5, 40})
    kept_pages = sum(e - s for s, e in (layout.page_span(5), layout.page_span(40)))   # 2 pages each: 1.5-page blocks
    assert pool.committed_bytes == kept_pages * page == 4 * page
    assert len(calls) == 3   # before block 5, between 5 and 40, after 40
    assert _holds(pool, 5, 6) and _holds(pool, 40, 41)
    pool.detach_blocks([b for b in range(64) if b not in (5, 40, 41)])
    assert pool.committed_bytes == 4 * page   # block 41 shares block 40's last page, none beyond it
