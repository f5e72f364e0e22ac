"""Resident set size of this process, for memory tests and reports."""

from __future__ import annotations

import mmap


def process_rss_bytes() -> int:
    """Current RSS in bytes; /proc/self/statm is one cheap read (smaps_rollup walks every mapping)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, IndexError, ValueError):
        return _rss_from_smaps_rollup()


def _rss_from_smaps_rollup() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("Rss missing from /proc/self/smaps_rollup")
