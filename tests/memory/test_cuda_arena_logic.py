"""CudaPageArena's page bookkeeping against a fake VMM driver, so it is checked on CPU machines too."""

import enum
from types import SimpleNamespace

import pytest
import torch

from elastic_hf.memory import MemoryBudget, MemoryBudgetExceeded
from elastic_hf.memory import cuda_arena

MiB = 1 << 20
GRANULE = 2 * MiB
BASE = 1 << 40


class FakeVmmDriver:
    """Checks the VMM rules the real driver enforces: map whole allocations, unmap what was mapped,
    set access only on mapped ranges, free the range only when nothing is mapped."""

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_OUT_OF_MEMORY = 2

    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED=1)
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE=1)
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE=3)
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM=0)
    CUdeviceptr = int
    CUstream = int

    def __init__(self, device_bytes):
        self.device_bytes = device_bytes
        self.handles = {}  # handle -> size, until released
        self.mapped = {}  # address -> (handle, size)
        self.reserved = None
        self.context_refs = 0
        self.context_depth = 0
        self.next_handle = 1
        self.memset_ranges = []

    @staticmethod
    def CUmemAllocationProp():
        return SimpleNamespace(type=None, location=SimpleNamespace(type=None, id=None))

    @staticmethod
    def CUmemAccessDesc():
        return SimpleNamespace(flags=None, location=SimpleNamespace(type=None, id=None))

    def _ok(self, *values):
        return (self.CUresult.CUDA_SUCCESS, *values)

    def _fail(self):
        return (self.CUresult.CUDA_ERROR_INVALID_VALUE,)

    def cuInit(self, flags):
        return self._ok()

    def cuDeviceGet(self, index):
        return self._ok(index)

    def cuDevicePrimaryCtxRetain(self, dev):
        self.context_refs += 1
        return self._ok("ctx")

    def cuDevicePrimaryCtxRelease(self, dev):
        self.context_refs -= 1
        return self._ok()

    def cuCtxPushCurrent(self, ctx):
        self.context_depth += 1
        return self._ok()

    def cuCtxPopCurrent(self):
        self.context_depth -= 1
        return self._ok("ctx")

    def cuCtxSynchronize(self):
        return self._ok()

    def cuGetErrorName(self, err):
        return self._ok(err.name.encode())

    def cuMemGetAllocationGranularity(self, prop, flags):
        assert prop.location.id == 0 and prop.type == 1
        return self._ok(GRANULE)

    def cuMemAddressReserve(self, size, alignment, addr, flags):
        assert self.context_depth == 1 and self.reserved is None and size % GRANULE == 0
        self.reserved = (BASE, size)
        return self._ok(BASE)

    def cuMemAddressFree(self, ptr, size):
        if self.mapped or self.reserved != (ptr, size):
            return self._fail()
        self.reserved = None
        return self._ok()

    def cuMemCreate(self, size, prop, flags):
        if sum(self.handles.values()) + size > self.device_bytes:
            return (self.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None)
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        self.handles[handle] = size
        return self._ok(handle)

    def cuMemRelease(self, handle):
        if handle not in self.handles:
            return self._fail()
        del self.handles[handle]  # simplification: a mapped handle would stay alive until unmapped
        return self._ok()

    def cuMemMap(self, ptr, size, offset, handle, flags):
        assert self.context_depth == 1
        if ptr in self.mapped or self.handles.get(handle) != size:
            return self._fail()
        self.mapped[ptr] = (handle, size)
        return self._ok()

    def cuMemUnmap(self, ptr, size):
        if ptr not in self.mapped or self.mapped[ptr][1] != size:
            return self._fail()
        del self.mapped[ptr]
        return self._ok()

    def _is_mapped(self, ptr, size):
        pos = ptr
        while pos < ptr + size:  # walk mapping after mapping; a gap means the range is not fully mapped
            if pos not in self.mapped:
                return False
            pos += self.mapped[pos][1]
        return True

    def cuMemSetAccess(self, ptr, size, descs, count):
        assert count == len(descs) == 1 and descs[0].flags == 3
        return self._ok() if self._is_mapped(ptr, size) else self._fail()

    def cuMemsetD8Async(self, ptr, value, size, stream):
        self.memset_ranges.append((ptr - BASE, size))
        return self._ok() if value == 0 and self._is_mapped(ptr, size) else self._fail()


@pytest.fixture
def fake(monkeypatch):
    driver = FakeVmmDriver(device_bytes=8 * GRANULE)
    monkeypatch.setattr(cuda_arena, "load_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: SimpleNamespace(cuda_stream=0))
    return driver


def test_commit_maps_one_allocation_per_page_and_zeroes_it(fake):
    budget = MemoryBudget(64 * MiB)
    arena = cuda_arena.CudaPageArena("cuda", 16 * MiB, budget, "kv")
    assert arena.page_size == GRANULE and arena.capacity_bytes == 16 * MiB and arena.base_ptr == BASE
    arena.commit(0, 3 * GRANULE)
    assert len(fake.handles) == 3 and sorted(fake.mapped) == [BASE + i * GRANULE for i in range(3)]
    assert fake.memset_ranges == [(0, 3 * GRANULE)]
    arena.commit(GRANULE, 3 * GRANULE)  # two pages already there: one new allocation
    assert len(fake.handles) == 4 and fake.memset_ranges[-1] == (3 * GRANULE, GRANULE)
    arena.decommit(GRANULE, GRANULE)
    assert len(fake.handles) == 3 and BASE + GRANULE not in fake.mapped
    assert arena.committed_bytes == 3 * GRANULE == budget.used_bytes("kv")
    assert fake.context_depth == 0
    arena.close()
    assert not fake.handles and not fake.mapped and fake.reserved is None and fake.context_refs == 0
    assert budget.used_bytes() == 0


def test_device_oom_rolls_back_the_whole_commit(fake):
    budget = MemoryBudget(64 * MiB)
    with cuda_arena.CudaPageArena("cuda", 32 * MiB, budget, "weights") as arena:
        arena.commit(0, 6 * GRANULE)
        with pytest.raises(MemoryError, match=f"out of memory creating page 8 \\({GRANULE} bytes\\)"):
            arena.commit(6 * GRANULE, 4 * GRANULE)  # the device has 8 granules in all
        assert arena.committed_bytes == 6 * GRANULE == budget.used_bytes("weights")
        assert len(fake.handles) == 6 and len(fake.mapped) == 6
        assert not arena.is_committed(6 * GRANULE, GRANULE)
        assert fake.context_depth == 0


def test_budget_is_checked_before_the_device_is_touched(fake):
    budget = MemoryBudget(2 * GRANULE)
    with cuda_arena.CudaPageArena("cuda", 16 * MiB, budget, "kv") as arena:
        with pytest.raises(MemoryBudgetExceeded, match=r"need 6\.0 MiB, 4\.0 MiB free of 4\.0 MiB"):
            arena.commit(0, 3 * GRANULE)
        assert not fake.handles and not fake.mapped


def test_page_size_must_be_a_multiple_of_the_granularity(fake):
    with pytest.raises(ValueError, match=f"page_size {MiB} must be a multiple of the VMM granularity {GRANULE}"):
        cuda_arena.CudaPageArena("cuda", 16 * MiB, MemoryBudget(64 * MiB), "kv", page_size=MiB)
    assert fake.context_refs == 0 and fake.reserved is None
    with cuda_arena.CudaPageArena("cuda:0", 16 * MiB, MemoryBudget(64 * MiB), "kv", page_size=2 * GRANULE) as arena:
        arena.commit(0, 2 * GRANULE)
        assert len(fake.handles) == 1 and fake.handles[1] == 2 * GRANULE  # one allocation per page
