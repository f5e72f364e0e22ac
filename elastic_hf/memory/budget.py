"""One ledger of committed bytes per worker, shared by all of its arenas (weights, KV, ...).

Morphs move committed bytes between owners; the budget is what makes "free the weights, then grow the
KV cache" a checked transfer instead of a hope.
"""

from __future__ import annotations

import threading

from elastic_hf.units import format_bytes, parse_memory_budget  # noqa: F401 - re-exported


class MemoryBudgetExceeded(MemoryError):
    """A charge would take the committed bytes of a worker past its memory budget."""


class MemoryBudget:
    def __init__(self, total_bytes: int) -> None:
        if isinstance(total_bytes, bool) or not isinstance(total_bytes, int) or total_bytes <= 0:
            raise ValueError(f"total_bytes must be a positive int, got {total_bytes!r}")
        self.total_bytes = total_bytes
        self._used_by_owner: dict[str, int] = {}
        self._used = 0
        # Arenas of one worker charge from the decode loop and the swapper thread concurrently.
        self._lock = threading.Lock()

    def charge(self, owner: str, nbytes: int) -> None:
        _check_nbytes(nbytes, "charge")
        with self._lock:
            free = self.total_bytes - self._used
            if nbytes > free:
                per_owner = ", ".join(f"{o} {format_bytes(n)}" for o, n in self._used_by_owner.items() if n)
                raise MemoryBudgetExceeded(
                    f"memory budget exceeded: need {format_bytes(nbytes)}, {format_bytes(free)} free of "
                    f"{format_bytes(self.total_bytes)} ({per_owner or 'nothing committed'}); "
                    f"{owner!r} asked for {nbytes} bytes")
            self._used_by_owner[owner] = self._used_by_owner.get(owner, 0) + nbytes
            self._used += nbytes

    def release(self, owner: str, nbytes: int) -> None:
        _check_nbytes(nbytes, "release")
        with self._lock:
            held = self._used_by_owner.get(owner, 0)
            if nbytes > held:
                # A double release means an arena's bookkeeping is broken; never hide it.
                raise ValueError(f"release of {nbytes} bytes by {owner!r} exceeds the {held} bytes it holds")
            self._used_by_owner[owner] = held - nbytes
            self._used -= nbytes

    def used_bytes(self, owner: str | None = None) -> int:
        with self._lock:
            return self._used if owner is None else self._used_by_owner.get(owner, 0)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self.total_bytes - self._used

    def report(self) -> dict[str, int]:
        """Bytes per owner plus "total" (the budget), "used" and "free"."""
        with self._lock:
            out = dict(self._used_by_owner)
            out.update(total=self.total_bytes, used=self._used, free=self.total_bytes - self._used)
            return out

    def __repr__(self) -> str:
        return f"MemoryBudget({format_bytes(self._used)} used of {format_bytes(self.total_bytes)})"


def _check_nbytes(nbytes: int, what: str) -> None:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"{what} needs a non-negative int number of bytes, got {nbytes!r}")


def device_total_bytes(device: torch.device | str) -> int:  # noqa: F821 - torch imported lazily
    """What a fractional budget is a fraction of: MemTotal on CPU, the GPU's total memory on CUDA."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory
    if device.type == "cpu":
        return cpu_total_bytes()
    raise ValueError(f"no memory budget support for device type {device.type!r} (cpu or cuda)")


def cpu_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB (KiB)
    raise RuntimeError("MemTotal missing from /proc/meminfo")
