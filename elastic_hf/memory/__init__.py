"""One memory model for CPU and GPU: page arenas charged against a per-worker memory budget."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elastic_hf.memory.arena import PageArena, round_up_to_page
from elastic_hf.memory.budget import (MemoryBudget, MemoryBudgetExceeded, cpu_total_bytes, device_total_bytes,
                                      format_bytes, parse_memory_budget)
from elastic_hf.memory.cpu_arena import CpuPageArena
from elastic_hf.memory.rss import process_rss_bytes

if TYPE_CHECKING:
    from elastic_hf.memory.cuda_arena import CudaPageArena

__all__ = [
    "default_page_size",
    "PageArena", "CpuPageArena", "CudaPageArena", "MemoryBudget", "MemoryBudgetExceeded", "create_arena",
    "round_up_to_page", "parse_memory_budget", "device_total_bytes", "cpu_total_bytes", "format_bytes",
    "process_rss_bytes",
]


def create_arena(device: torch.device | str, capacity_bytes: int, budget: MemoryBudget, owner: str,
                 page_size: int | None = None, huge_pages: bool = False) -> PageArena:
    """An arena of the backend matching device.type; page_size None means the backend's natural page.
    huge_pages asks the CPU backend for transparent huge pages (CUDA granules are 2 MiB already)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CpuPageArena(capacity_bytes, budget, owner, page_size=page_size, huge_pages=huge_pages)
    if device.type == "cuda":
        from elastic_hf.memory.cuda_arena import CudaPageArena

        return CudaPageArena(device, capacity_bytes, budget, owner, page_size=page_size)
    raise ValueError(f"no PageArena backend for device type {device.type!r} (cpu or cuda)")


def __getattr__(name: str):
    # CudaPageArena stays importable by name without making cuda-python a hard dependency.
    if name == "CudaPageArena":
        from elastic_hf.memory.cuda_arena import CudaPageArena

        return CudaPageArena
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_page_size(device: torch.device | str) -> int:
    """The backend's natural page: the OS page on CPU, the VMM allocation granularity on CUDA."""
    device = torch.device(device)
    if device.type == "cpu":
        import mmap

        return mmap.PAGESIZE
    if device.type == "cuda":
        return 2 << 20  # the VMM minimum granularity of current NVIDIA GPUs; CudaPageArena checks it
    raise ValueError(f"no PageArena backend for device type {device.type!r} (cpu or cuda)")
