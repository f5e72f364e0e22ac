import sys

import pytest
import torch

from elastic_hf.memory import MemoryBudget, MemoryBudgetExceeded, PageArena, create_arena

MiB = 1 << 20


def _require_cuda_python():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        from elastic_hf.memory.cuda_arena import load_driver

        load_driver()
    except ImportError:
        pytest.skip("needs cuda-python (pip install 'elastic-hf[gpu]')")


@pytest.fixture
def budget():
    return MemoryBudget(1 << 30)


@pytest.fixture
def arena(budget):
    _require_cuda_python()
    arena = create_arena("cuda", 256 * MiB, budget, "kv")
    yield arena
    arena.close()


def test_missing_cuda_python_names_the_extra(monkeypatch):
    # None in sys.modules makes the import fail as if the package were not installed.
    for name in ("cuda", "cuda.bindings", "cuda.bindings.driver", "cuda.cuda"):
        monkeypatch.setitem(sys.modules, name, None)
    from elastic_hf.memory.cuda_arena import load_driver

    with pytest.raises(ImportError, match=r"pip install 'elastic-hf\[gpu\]'"):
        load_driver()


@pytest.mark.gpu
def test_backend_and_page_size(arena):
    from elastic_hf.memory.cuda_arena import CudaPageArena

    assert isinstance(arena, CudaPageArena) and isinstance(arena, PageArena)
    assert arena.device.type == "cuda" and arena.device.index is not None
    assert arena.page_size == arena.granularity and arena.page_size % (2 * MiB) == 0
    assert arena.capacity_bytes == 256 * MiB and arena.committed_bytes == 0


@pytest.mark.gpu
def test_commit_and_decommit_move_device_memory(arena, budget):
    nbytes = 128 * MiB
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info(arena.device)
    arena.commit(0, nbytes)
    free_committed, _ = torch.cuda.mem_get_info(arena.device)
    # The driver may round or keep a little bookkeeping; physical pages are what dominates.
    assert free_before - free_committed >= nbytes - 8 * MiB
    assert budget.used_bytes("kv") == nbytes
    arena.view(0, (nbytes // 4,), torch.float32).fill_(1.0)
    arena.decommit(0, nbytes)
    free_after, _ = torch.cuda.mem_get_info(arena.device)
    assert free_after - free_committed >= nbytes - 8 * MiB
    assert budget.used_bytes("kv") == 0 and arena.committed_bytes == 0


@pytest.mark.gpu
def test_views_are_zero_copy_and_recommit_reads_zero(arena):
    page = arena.page_size
    arena.commit(0, 3 * page)
    as_float = arena.view(page, (page // 4,), torch.float32)
    as_bytes = arena.view(page, (page,), torch.uint8)
    as_bf16 = arena.view(page, (2, 8), torch.bfloat16)
    assert as_float.data_ptr() == as_bytes.data_ptr() == as_bf16.data_ptr() == arena.base_ptr + page
    as_float[3] = 1.0
    assert as_bytes[12:16].tolist() == [0, 0, 0x80, 0x3F]
    as_bf16[0, 7] = 2.0
    assert as_float[3].item() == 2.0
    everything = arena.view(0, (3, page), torch.uint8)
    everything.fill_(9)
    arena.decommit(page, page)
    arena.commit(page, page)
    everything = arena.view(0, (3, page), torch.uint8)
    torch.cuda.synchronize()
    assert (everything[0] == 9).all() and (everything[2] == 9).all()
    assert (everything[1] == 0).all()


@pytest.mark.gpu
def test_views_work_in_kernels_across_pages(arena):
    page = arena.page_size
    arena.commit(0, 4 * page)
    a = arena.view(0, (page // 4, 2), torch.float32)  # spans pages 0 and 1 (two physical allocations)
    b = arena.view(2 * page, (2, page // 4), torch.float32)
    a.copy_(torch.randn(page // 4, 2, device=arena.device))
    b.copy_(torch.randn(2, page // 4, device=arena.device))
    torch.testing.assert_close(b @ a, b.clone() @ a.clone())   # [2, 2]: reads both views across their pages


@pytest.mark.gpu
def test_whole_range_view_starting_on_an_uncommitted_page(arena):
    page = arena.page_size
    # Page 0 has no physical memory: this view must be built without asking the driver about it.
    base = arena.view(0, (4, page // 4), torch.float32, require_committed=False)
    assert base.device == arena.device and base.data_ptr() == arena.base_ptr
    arena.commit(2 * page, page)
    base[2].fill_(3.0)
    assert (arena.view(2 * page, (page // 4,), torch.float32) == 3.0).all()
    arena.decommit(2 * page, page)


@pytest.mark.gpu
def test_budget_and_range_errors(arena):
    page = arena.page_size
    small = MemoryBudget(2 * page)
    with create_arena(arena.device, 8 * page, small, "weights") as weights:
        weights.commit(0, page)
        with pytest.raises(MemoryBudgetExceeded, match="memory budget exceeded: need"):
            weights.commit(page, 2 * page)
        assert weights.committed_bytes == page == small.used_bytes()
        with pytest.raises(ValueError, match="touches uncommitted pages"):
            weights.view(0, (2 * page,), torch.uint8)
        with pytest.raises(ValueError, match=f"exceeds capacity {8 * page}"):
            weights.commit(8 * page, page)
    assert small.used_bytes() == 0


@pytest.mark.gpu
def test_close_releases_all_memory(budget):
    _require_cuda_python()
    torch.cuda.synchronize()
    free_before, _ = torch.cuda.mem_get_info()
    arena = create_arena("cuda", 64 * MiB, budget, "kv")
    arena.commit(0, 64 * MiB)
    arena.close()
    free_after, _ = torch.cuda.mem_get_info()
    assert abs(free_after - free_before) <= 8 * MiB
    assert budget.used_bytes() == 0
