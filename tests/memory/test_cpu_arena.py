import gc
import mmap
import threading
import weakref

import pytest
import torch

from elastic_hf.memory import (CpuPageArena, MemoryBudget, MemoryBudgetExceeded, PageArena, create_arena,
                               process_rss_bytes, round_up_to_page)

MiB = 1 << 20
PAGE = mmap.PAGESIZE
# RSS also moves with the allocator and lazily loaded code; 8 MiB of slack on 64 MiB is still unambiguous.
RSS_SLACK = 8 * MiB


@pytest.fixture
def budget():
    return MemoryBudget(256 * MiB)


@pytest.fixture
def arena(budget):
    arena = create_arena("cpu", 128 * MiB, budget, "kv")
    yield arena
    arena.close()


def test_create_arena_picks_cpu_backend(arena):
    assert isinstance(arena, CpuPageArena) and isinstance(arena, PageArena)
    assert arena.device == torch.device("cpu")
    assert arena.page_size == PAGE
    assert arena.capacity_bytes == 128 * MiB
    assert arena.owner == "kv"
    assert arena.committed_bytes == 0


def test_capacity_rounds_up_and_page_size_is_configurable(budget):
    with CpuPageArena(10 * PAGE + 1, budget, "weights", page_size=4 * PAGE) as arena:
        assert arena.page_size == 4 * PAGE
        assert arena.capacity_bytes == 12 * PAGE
        assert arena.round_up_to_page(1) == 4 * PAGE
    assert round_up_to_page(PAGE + 1, PAGE) == 2 * PAGE
    assert round_up_to_page(0, PAGE) == 0
    with pytest.raises(ValueError, match="multiple of the OS page size"):
        CpuPageArena(MiB, budget, "kv", page_size=PAGE + 512)


def test_rss_rises_on_write_and_drops_on_decommit(arena, budget):
    nbytes = 64 * MiB
    arena.commit(0, nbytes)
    assert budget.used_bytes("kv") == nbytes
    tensor = arena.view(0, (nbytes // 4,), torch.float32)
    gc.collect()
    before_write = process_rss_bytes()
    tensor.fill_(1.5)
    after_write = process_rss_bytes()
    assert after_write - before_write >= nbytes - RSS_SLACK
    arena.decommit(0, nbytes)
    after_decommit = process_rss_bytes()
    assert after_write - after_decommit >= nbytes - RSS_SLACK
    assert budget.used_bytes("kv") == 0 and arena.committed_bytes == 0


def test_prefault_populates_on_commit(budget):
    with CpuPageArena(64 * MiB, budget, "weights", prefault=True) as arena:
        before = process_rss_bytes()
        arena.commit(0, 32 * MiB)
        assert process_rss_bytes() - before >= 32 * MiB - RSS_SLACK
        assert arena.view(0, (8 * MiB,), torch.int32).abs().sum().item() == 0


def test_decommitted_pages_read_back_zero(arena):
    arena.commit(0, 4 * PAGE)
    arena.view(0, (4 * PAGE,), torch.uint8).fill_(7)
    arena.decommit(PAGE, 2 * PAGE)
    arena.commit(PAGE, 2 * PAGE)
    data = arena.view(0, (4, PAGE), torch.uint8)
    assert (data[0] == 7).all() and (data[3] == 7).all()
    assert (data[1:3] == 0).all()


def test_views_are_zero_copy(arena):
    arena.commit(0, 2 * PAGE)
    as_float = arena.view(PAGE, (16,), torch.float32)
    as_bytes = arena.view(PAGE, (64,), torch.uint8)
    as_bf16 = arena.view(PAGE, (2, 16), torch.bfloat16)
    as_float[3] = 1.0
    assert as_bytes[12:16].tolist() == [0, 0, 0x80, 0x3F]  # little-endian 1.0f
    as_bf16[0, 7] = 2.0  # bf16 element 7 = upper half of float 3
    assert as_float[3].item() == 2.0
    assert as_float.data_ptr() == as_bytes.data_ptr() == as_bf16.data_ptr()
    assert as_float.shape == (16,) and as_bf16.shape == (2, 16)


def test_commit_is_idempotent_per_page(arena, budget):
    arena.commit(0, 4 * PAGE)
    arena.commit(2 * PAGE, 4 * PAGE)  # pages 2, 3 already committed: charges only 4, 5
    assert arena.committed_bytes == 6 * PAGE == budget.used_bytes("kv")
    arena.decommit(0, 8 * PAGE)  # pages 6, 7 were never committed: releases only 6 pages
    assert arena.committed_bytes == 0 == budget.used_bytes()
    assert arena.is_committed(0, 0) and not arena.is_committed(0, 1)


def test_is_committed_covers_every_overlapping_page(arena):
    arena.commit(PAGE, 2 * PAGE)
    assert arena.is_committed(PAGE, 2 * PAGE)
    assert arena.is_committed(PAGE + 10, PAGE)
    assert not arena.is_committed(PAGE - 1, 2)
    assert not arena.is_committed(2 * PAGE, PAGE + 1)


def test_view_outside_committed_pages_raises(arena):
    arena.commit(0, PAGE)
    with pytest.raises(ValueError, match=f"view of {2 * PAGE} bytes at offset 0 touches uncommitted pages"):
        arena.view(0, (2 * PAGE,), torch.uint8)
    with pytest.raises(ValueError, match="not aligned to the 4-byte itemsize"):
        arena.view(2, (1,), torch.float32)
    with pytest.raises(ValueError, match="exceeds capacity"):
        arena.view(arena.capacity_bytes - 4, (2,), torch.float32)
    assert arena.view(0, (0, 5), torch.float32).shape == (0, 5)


def test_range_errors_have_numbers(budget):
    with CpuPageArena(2 * MiB, budget, "kv") as arena:
        with pytest.raises(ValueError, match="commit of 4194304 bytes at offset 8192 exceeds capacity 2097152"):
            arena.commit(8192, 4 * MiB)
        with pytest.raises(ValueError, match=f"offset 100, nbytes {PAGE}, page size {PAGE}"):
            arena.commit(100, PAGE)
        with pytest.raises(ValueError, match="page-aligned"):
            arena.decommit(0, 100)


def test_budget_exceeded_leaves_arena_unchanged():
    budget = MemoryBudget(8 * MiB)
    weights = CpuPageArena(16 * MiB, budget, "weights")
    kv = CpuPageArena(16 * MiB, budget, "kv")
    weights.commit(0, 6 * MiB)
    kv.commit(0, MiB)
    with pytest.raises(MemoryBudgetExceeded, match=r"need 2\.0 MiB, 1\.0 MiB free of 8\.0 MiB "
                                                   r"\(weights 6\.0 MiB, kv 1\.0 MiB\)"):
        kv.commit(MiB, 2 * MiB)
    assert kv.committed_bytes == MiB and not kv.is_committed(MiB, PAGE)
    # Morph: weights give bytes back, then the KV cache can take them.
    weights.decommit(4 * MiB, 2 * MiB)
    kv.commit(MiB, 2 * MiB)
    assert budget.report() == {"weights": 4 * MiB, "kv": 3 * MiB, "total": 8 * MiB, "used": 7 * MiB,
                               "free": MiB}
    weights.close()
    kv.close()
    assert budget.used_bytes() == 0


def test_close_with_live_views_releases_everything(budget):
    arena = CpuPageArena(8 * MiB, budget, "kv")
    arena.commit(0, 8 * MiB)
    view = arena.view(0, (MiB,), torch.float64)
    view.fill_(3.0)
    arena.close()  # mmap.close() would raise BufferError here: the view still exports the buffer
    arena.close()  # idempotent
    assert arena.closed and budget.used_bytes() == 0
    with pytest.raises(RuntimeError, match="closed"):
        arena.commit(0, PAGE)
    with pytest.raises(RuntimeError, match="closed"):
        arena.view(0, (1,), torch.uint8)
    assert view.sum().item() == 0  # still mapped (zero pages) until the view dies
    del view


def test_close_unmaps_once_the_last_view_dies(budget):
    arena = CpuPageArena(MiB, budget, "kv")
    arena.commit(0, PAGE)
    mapping = weakref.ref(arena._mmap)
    view = arena.view(0, (4,), torch.float32)[1:]  # a derived view keeps the mapping alive too
    arena.close()
    assert mapping() is not None
    del view
    assert mapping() is None


def test_concurrent_commits_keep_ledger_consistent(budget):
    with CpuPageArena(4 * MiB, budget, "kv") as arena:
        def worker(first_page):
            for page in range(first_page, arena.num_pages, 2):
                arena.commit(page * PAGE, PAGE)
                arena.commit(0, 2 * PAGE)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert arena.committed_bytes == 4 * MiB == budget.used_bytes("kv")


def test_whole_range_view_may_span_uncommitted_pages(arena, budget):
    base = arena.view(0, (4, PAGE), torch.uint8, require_committed=False)  # like the KV pool's base view
    assert budget.used_bytes() == 0
    arena.commit(2 * PAGE, PAGE)
    base[2].fill_(4)
    assert (arena.view(2 * PAGE, (PAGE,), torch.uint8) == 4).all()
    arena.decommit(2 * PAGE, PAGE)
    assert base.sum().item() == 0


def test_dlpack_wrapper_is_zero_copy_and_releases_its_keepalive():
    from elastic_hf.memory._dlpack import num_live_wrappers, tensor_from_pointer

    owner = torch.arange(16, dtype=torch.uint8)
    live_before = num_live_wrappers()
    wrapped = tensor_from_pointer(owner.data_ptr() + 4, 8, torch.device("cpu"), keepalive=owner)
    assert wrapped.tolist() == list(range(4, 12)) and wrapped.data_ptr() == owner.data_ptr() + 4
    wrapped[0] = 99
    assert owner[4].item() == 99
    derived = wrapped.view(torch.int32)
    del wrapped
    assert num_live_wrappers() == live_before + 1  # the derived view still shares the storage
    del derived
    assert num_live_wrappers() == live_before
