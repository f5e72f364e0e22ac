"""glibc malloc settings for a process that runs model steps on the CPU.

Every step allocates and frees its activations (a 512-token prefill of the default model: tensors of 1-6 MB,
tens of MB per layer in all). glibc adapts its mmap threshold to the largest block freed so far and returns the
free top of a heap to the OS once it exceeds twice that, so the next step faults the same pages in again: on the
engine thread (a per-thread arena, whose heaps shrink with MADV_DONTNEED) single prefill steps of the default
model took 25,000 minor faults, ~30 ms of a ~330 ms step. Fixed thresholds keep the freed memory for the next step
(vLLM's CPU build preloads tcmalloc for the same reason). The process keeps at most its peak transient footprint;
arena pages (weights, KV) are separate mappings and are not affected."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import threading

log = logging.getLogger(__name__)

# mallopt(3) parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3

# glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (HEAP_MAX_SIZE / 2): allocations up to this come from the heaps.
MMAP_THRESHOLD_BYTES = 32 << 20
# free memory a heap keeps at its top before any goes back to the OS
TRIM_THRESHOLD_BYTES = 512 << 20
# extra bytes requested whenever a heap grows, so growth happens in few large steps
TOP_PAD_BYTES = 64 << 20

_lock = threading.Lock()
_tuned: bool | None = None


def tune_host_malloc() -> bool:
    """Apply the fixed thresholds once per process. True when glibc took them; False where the C library is not
    glibc (musl, macOS): nothing changes there."""
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = _apply()
        return _tuned


def _apply() -> bool:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # only glibc has it; another libc's mallopt may read the numbers differently
    except (OSError, AttributeError, TypeError):
        log.debug("no glibc mallopt (%s): host malloc left as it is", name)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                (_M_TOP_PAD, TOP_PAD_BYTES))
    ok = all(mallopt(param, value) == 1 for param, value in settings)   # mallopt returns 1 on success
    log.debug("glibc malloc: mmap threshold %d, trim threshold %d, top pad %d (%s)", MMAP_THRESHOLD_BYTES,
              TRIM_THRESHOLD_BYTES, TOP_PAD_BYTES, "applied" if ok else "refused")
    return ok
