"""One ledger of committed bytes per worker, shared by all of its arenas (weights, KV, ...).

Morphs move committed bytes between owners; the budget is what makes "free the weights, then grow the
KV cache" a checked transfer instead of a hope.
"""

from __future__ import annotations

import re
import threading

_MiB = 1 << 20


class MemoryBudgetExceeded(MemoryError):
    """A charge would take the committed bytes of a worker past its memory budget."""


def format_bytes(nbytes: int) -> str:
    return f"{nbytes / _MiB:.1f} MiB"


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


_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def parse_memory_budget(value: int | float | str, device_total_bytes: int | None) -> int:
    """Bytes from an int, a size string ("512MiB", "2GB", "1.5GiB"), or a fraction of the device
    ("0.8", 0.8, "80%"). Integers are bytes; a number with a decimal point in (0, 1] is a fraction."""
    if isinstance(value, bool):
        raise ValueError(f"memory budget must be bytes, a size string or a fraction, got {value!r}")
    if isinstance(value, int):
        return _checked(value, value, device_total_bytes)
    if isinstance(value, float):
        if 0 < value <= 1:
            return _fraction(value, value, device_total_bytes)
        if value.is_integer():
            return _checked(int(value), value, device_total_bytes)
        raise ValueError(f"memory budget {value!r} is neither a fraction in (0, 1] nor a whole number of bytes")
    if not isinstance(value, str):
        raise ValueError(f"memory budget must be an int, float or str, got {type(value).__name__}")
    match = _SIZE_RE.match(value)
    if match is None or match.group(2).lower() not in _UNITS and match.group(2) != "%":
        raise ValueError(f"cannot parse memory budget {value!r}: use bytes (1073741824), a size "
                         f"('512MiB', '2GB', '1.5GiB') or a fraction of the device ('0.8', '80%')")
    number, unit = match.group(1), match.group(2).lower()
    if unit == "%":
        return _fraction(float(number) / 100, value, device_total_bytes)
    if unit == "" and ("." in number or "e" in number.lower()):
        fraction = float(number)
        if 0 < fraction <= 1:
            return _fraction(fraction, value, device_total_bytes)
        raise ValueError(f"memory budget {value!r} looks like a fraction but is not in (0, 1]")
    if unit == "":
        return _checked(int(number), value, device_total_bytes)
    return _checked(int(float(number) * _UNITS[unit]), value, device_total_bytes)


def _fraction(fraction: float, raw, device_total_bytes: int | None) -> int:
    if not 0 < fraction <= 1:
        raise ValueError(f"memory budget fraction {raw!r} must be in (0, 1]")
    if not device_total_bytes:
        raise ValueError(f"memory budget {raw!r} is a fraction but the device size is unknown")
    return _checked(int(fraction * device_total_bytes), raw, device_total_bytes)


def _checked(nbytes: int, raw, device_total_bytes: int | None) -> int:
    if nbytes <= 0:
        raise ValueError(f"memory budget must be > 0 bytes, got {raw!r}")
    if device_total_bytes and nbytes > device_total_bytes:
        raise ValueError(f"memory budget {raw!r} = {format_bytes(nbytes)} exceeds the device's "
                         f"{format_bytes(device_total_bytes)}")
    return nbytes


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
