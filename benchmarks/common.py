"""Helpers of the benchmarks: data paths, prompts cut from wikitext, machine description."""
from __future__ import annotations

import os
import platform
import random
from pathlib import Path

import torch

PROJECT_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(__file__).resolve().parent / "data"   # benchmark-only data (README.md there: source, licence)


def wikitext_text() -> str:
    """The WikiText-2 validation text shipped with the package (elastic_hf/data/NOTICE.md)."""
    from elastic_hf.paths import default_calibration_text

    return default_calibration_text().read_text()


def wikitext_prompts(tokenizer, num_prompts: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of random length in [min_tokens, max_tokens], cut at random offsets of wikitext."""
    text = wikitext_text()
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
