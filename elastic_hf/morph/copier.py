"""Asynchronous host -> arena copies for layer swaps, so a swap never blocks the decode loop.

CPU: one copy thread running a plain memmove (ctypes releases the GIL, so it runs beside the forward pass). Not
torch's copy_: that splits a large copy over OpenMP threads, and a second thread opening parallel regions gives the
process a second OpenMP pool, more OpenMP threads than cores, and libgomp's throttled spinning for every region of
the engine thread's forward passes too (see engine/async_engine.py).
CUDA: a side stream plus an event per copy (MorphServe Appendix C: morphing and decoding on separate streams);
the pinned source makes the copy a true DMA that overlaps compute."""
from __future__ import annotations

import ctypes
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyHandle:
    """done() is non-blocking; wait() blocks. `seconds` is the copy's own duration once done (CPU: measured on
    the copy thread; CUDA: event elapsed time)."""

    def __init__(self, future: Future | None = None, events: tuple | None = None):
        self._future = future
        self._events = events
        self.nbytes = 0

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._events[1].query()

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()
        else:
            self._events[1].synchronize()

    @property
    def seconds(self) -> float:
        if self._future is not None:
            return self._future.result()
        return self._events[0].elapsed_time(self._events[1]) / 1e3

    def raise_if_failed(self) -> None:
        if self._future is not None and self._future.done():
            self._future.result()


class CpuCopier:
    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elastic-hf-swap")

    @staticmethod
    def _copy(dst: torch.Tensor, src: torch.Tensor) -> float:
        if not (dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype == torch.uint8
                and dst.numel() == src.numel()):
            raise ValueError(f"swap copies take two contiguous uint8 tensors of one size, got {dst.dtype} "
                             f"{tuple(dst.shape)} and {src.dtype} {tuple(src.shape)}")
        started = time.perf_counter()
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), src.numel())
        return time.perf_counter() - started

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """dst, src: uint8 [nbytes]."""
        handle = CopyHandle(future=self._pool.submit(self._copy, dst, src))
        handle.nbytes = src.numel()
        return handle

    def sync_compute(self) -> None:
        """Nothing to wait for: CPU forwards are synchronous, so at a step boundary no kernel reads weights."""

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class CudaCopier:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> CopyHandle:
        """dst: uint8 [nbytes] in the device arena; src: pinned uint8 [nbytes] on the host."""
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # CudaPageArena.commit zeroes fresh pages with a memset on the *current* stream; without this edge the
        # side-stream copy could land first and then be wiped. (An event dependency: the CPU does not block.)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            dst.copy_(src, non_blocking=True)
            end.record(self.stream)
        handle = CopyHandle(events=(start, end))
        handle.nbytes = src.numel()
        return handle

    def sync_compute(self) -> None:
        """Before a region is unmapped, every kernel already queued on the compute stream must have finished
        reading it (the step's sampling usually synchronized already; this makes it certain)."""
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        self.stream.synchronize()


def make_copier(device: torch.device):
    return CudaCopier(device) if device.type == "cuda" else CpuCopier()
