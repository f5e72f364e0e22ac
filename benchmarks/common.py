"""Shared helpers for benchmarks: data paths, prompts cut from wikitext, machine description."""
from __future__ import annotations

import os
import platform
import random
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path:
    env = os.environ.get("ELASTIC_HF_DATA")
    candidates = [Path(env)] if env else []
    candidates += [PROJECT_ROOT.parent / "shared" / "data", PROJECT_ROOT / "shared" / "data"]
    for path in candidates:
        if path.is_dir():
            return path
    raise FileNotFoundError(f"shared data directory not found (looked in {[str(c) for c in candidates]}); "
                            "set ELASTIC_HF_DATA")


def wikitext_prompts(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of random length in [min_tokens, max_tokens], cut at random offsets of wikitext."""
    text = (shared_data_dir() / "wikitext2-valid.txt").read_text()
    ids = tokenizer.encode(text[:400_000], add_special_tokens=False)
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        length = rng.randint(min_tokens, max_tokens)
        start = rng.randint(0, len(ids) - length - 1)
        prompts.append(ids[start:start + length])
    return prompts


def machine_description() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads)")
