"""CUDA PageArena on the driver's virtual memory management (VMM) API, through cuda-python.

One reserved virtual range; every committed page gets its own physical allocation (cuMemCreate +
cuMemMap), so decommitting a page (cuMemUnmap + cuMemRelease) hands exactly that page back to the
device while tensors elsewhere in the range keep their addresses.
"""

from __future__ import annotations

from typing import Any

import torch

from elastic_hf.memory._dlpack import tensor_from_pointer
from elastic_hf.memory.arena import PageArena
from elastic_hf.memory.budget import MemoryBudget, format_bytes

_INSTALL_HINT = "CudaPageArena needs cuda-python: pip install 'elastic-hf[gpu]' (or pip install cuda-python)"


def load_driver() -> Any:
    """The cuda-python driver module: `cuda.bindings.driver` (>= 12.6, 13.x) or the older `cuda.cuda`."""
    try:
        from cuda.bindings import driver
        return driver
    except ImportError:
        pass
    try:
        from cuda import cuda as driver  # cuda-python < 12.6
        return driver
    except ImportError as exc:
        raise ImportError(_INSTALL_HINT) from exc


class _CudaArray:
    """Just enough of __cuda_array_interface__ (v3) for torch.as_tensor to wrap device bytes.

    torch keeps a reference to this object for the tensor's lifetime, which keeps the arena alive too.
    """

    __slots__ = ("__cuda_array_interface__", "arena")

    def __init__(self, ptr: int, nbytes: int, arena: "CudaPageArena") -> None:
        # Bytes, not the real dtype: the interface's numpy typestrs cannot name bfloat16 or float8.
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None, "version": 3,
            "stream": None,  # no producer stream to wait on: commit already ordered its memset
        }
        self.arena = arena


class CudaPageArena(PageArena):
    def __init__(self, device: torch.device | str | int, capacity_bytes: int, budget: MemoryBudget, owner: str,
                 page_size: int | None = None) -> None:
        self._driver = drv = load_driver()
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaPageArena needs a cuda device, got {device}")
        if not torch.cuda.is_available():
            raise RuntimeError("CudaPageArena needs a CUDA device, but torch.cuda.is_available() is False")
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
        self._reserved_ptr = 0
        self._context = None

        _check(drv, drv.cuInit(0), "cuInit")
        self._cu_device = _check(drv, drv.cuDeviceGet(index), "cuDeviceGet")
        # torch's runtime calls use the primary context too; retaining it makes it current-able here
        # even before torch has touched the device.
        self._context = _check(drv, drv.cuDevicePrimaryCtxRetain(self._cu_device), "cuDevicePrimaryCtxRetain")

        try:
            prop = drv.CUmemAllocationProp()
            prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = index
            self._prop = prop
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = index
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = access
            granularity = int(_check(drv, drv.cuMemGetAllocationGranularity(
                prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
                "cuMemGetAllocationGranularity"))
            page_size = granularity if page_size is None else page_size
            if page_size % granularity:
                raise ValueError(f"page_size {page_size} must be a multiple of the VMM granularity {granularity} "
                                 f"of {device}")
            super().__init__(device, capacity_bytes, page_size, budget, owner)
            self.granularity = granularity
            # Physical allocation handle of each committed page, None where decommitted.
            self._handles: list[Any] = [None] * self.num_pages
            with self._current():
                ptr = _check(drv, drv.cuMemAddressReserve(self.capacity_bytes, page_size, 0, 0),
                             "cuMemAddressReserve")
            self._reserved_ptr = int(ptr)
        except BaseException:
            # A failed constructor has no close(); give back the context reference it took.
            drv.cuDevicePrimaryCtxRelease(self._cu_device)
            self._context = None
            raise

    @property
    def base_ptr(self) -> int:
        return self._reserved_ptr

    def _commit_pages(self, first: int, end: int) -> None:
        drv = self._driver
        start, length = first * self.page_size, (end - first) * self.page_size
        with self._current():
            mapped = first
            try:
                for page in range(first, end):
                    handle = self._create(page)
                    self._handles[page] = handle
                    _check(drv, drv.cuMemMap(self._ptr(page * self.page_size), self.page_size, 0, handle, 0),
                           "cuMemMap")
                    mapped = page + 1
                # One call may span several mappings as long as all of them are fully mapped.
                _check(drv, drv.cuMemSetAccess(self._ptr(start), length, [self._access], 1), "cuMemSetAccess")
                # Fresh physical memory is not guaranteed to be zero; the arena contract says it is.
                # Ordered on torch's current stream so kernels queued after the commit see zeros.
                stream = torch.cuda.current_stream(self.device).cuda_stream
                _check(drv, drv.cuMemsetD8Async(self._ptr(start), 0, length, drv.CUstream(stream)),
                       "cuMemsetD8Async")
            except BaseException:
                self._unmap_and_release(first, end, mapped)
                raise

    def _decommit_pages(self, first: int, end: int) -> None:
        with self._current():
            # Kernels queued on any stream may still read these pages; unmapping under them would fault.
            _check(self._driver, self._driver.cuCtxSynchronize(), "cuCtxSynchronize")
            self._unmap_and_release(first, end, end)

    def _view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype, numel: int) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        ptr = self._reserved_ptr + offset
        if self._committed[offset // self.page_size]:
            raw = torch.as_tensor(_CudaArray(ptr, nbytes, self), device=self.device)
        else:
            # torch.as_tensor asks the driver which device owns the first byte, which fails on an
            # unmapped VMM address (require_committed=False views); DLPack states the device instead.
            raw = tensor_from_pointer(ptr, nbytes, self.device, self)
        # [nbytes] uint8 -> the caller's dtype and shape, still the same memory
        return raw.view(dtype).view(shape)

    def _release_reservation(self) -> None:
        drv = self._driver
        if self._reserved_ptr:
            with self._current():
                _check(drv, drv.cuMemAddressFree(self._ptr(0), self.capacity_bytes), "cuMemAddressFree")
            self._reserved_ptr = 0
        if self._context is not None:
            _check(drv, drv.cuDevicePrimaryCtxRelease(self._cu_device), "cuDevicePrimaryCtxRelease")
            self._context = None

    def __del__(self) -> None:
        # Only a safety net for arenas never closed; interpreter shutdown may already have torn down CUDA.
        try:
            if not self._closed and getattr(self, "_reserved_ptr", 0):
                self.close()
        except Exception:
            pass

    # ---- helpers ----------------------------------------------------------------------------------

    def _create(self, page: int) -> Any:
        drv = self._driver
        err, handle = drv.cuMemCreate(self.page_size, self._prop, 0)
        if err == drv.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
            raise MemoryError(f"{self.device} is out of memory creating page {page} ({self.page_size} bytes); "
                              f"{self.owner!r} arena holds {format_bytes(self.committed_bytes)}, budget "
                              f"{format_bytes(self.budget.used_bytes())} used of "
                              f"{format_bytes(self.budget.total_bytes)}")
        _check(drv, (err,), "cuMemCreate")
        return handle

    def _unmap_and_release(self, first: int, end: int, mapped_end: int) -> None:
        """Undo pages [first, end); only [first, mapped_end) were mapped. Errors surface after cleanup."""
        drv = self._driver
        failure = None
        for page in range(first, end):
            handle = self._handles[page]
            if handle is None:
                continue
            results = []
            if page < mapped_end:
                results.append((drv.cuMemUnmap(self._ptr(page * self.page_size), self.page_size), "cuMemUnmap"))
            # Release drops our reference; the memory returns once the page is also unmapped.
            results.append((drv.cuMemRelease(handle), "cuMemRelease"))
            self._handles[page] = None
            for result, what in results:
                try:
                    _check(drv, result, what)
                except RuntimeError as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure

    def _ptr(self, offset: int) -> Any:
        return self._driver.CUdeviceptr(self._reserved_ptr + offset)

    def _current(self) -> "_PushedContext":
        return _PushedContext(self._driver, self._context)


class _PushedContext:
    """Make the device's primary context current for a few driver calls, whatever thread we are on."""

    __slots__ = ("drv", "ctx")

    def __init__(self, drv: Any, ctx: Any) -> None:
        self.drv, self.ctx = drv, ctx

    def __enter__(self) -> None:
        _check(self.drv, self.drv.cuCtxPushCurrent(self.ctx), "cuCtxPushCurrent")

    def __exit__(self, *exc) -> None:
        _check(self.drv, self.drv.cuCtxPopCurrent(), "cuCtxPopCurrent")


def _check(drv: Any, result: tuple, what: str) -> Any:
    """cuda-python returns (CUresult, *values); raise on error, else return the value(s)."""
    err, *values = result
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise RuntimeError(f"{what} failed: {name} ({int(getattr(err, 'value', err))})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)
