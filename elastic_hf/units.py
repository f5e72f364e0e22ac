"""Byte and count arithmetic shared by every package (torch-free): ceiling division, rounding up to a multiple
(pages, alignment, blocks), human-readable sizes, and parsing memory sizes given by users."""
from __future__ import annotations

import re

_MiB = 1 << 20


def ceil_div(numerator: int, denominator: int) -> int:
    """Smallest integer >= numerator / denominator (e.g. KV blocks for a number of tokens)."""
    if denominator <= 0:
        raise ValueError(f"denominator must be > 0, got {denominator}")
    return -(-numerator // denominator)


def round_up(nbytes: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that holds nbytes (pages, alignment)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return ceil_div(nbytes, multiple) * multiple


def format_bytes(nbytes: int) -> str:
    return f"{nbytes / _MiB:.1f} MiB"


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
