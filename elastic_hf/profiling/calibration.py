"""Calibration data of the offline profiler and of AWQ: reading a text file, tokenizing it, held-out splits and
fixed random windows. The default text ships with the package (elastic_hf/data, see paths.py)."""
from __future__ import annotations

from pathlib import Path

import torch

from elastic_hf.paths import default_calibration_text

__all__ = ["default_calibration_text", "read_text", "tokenize_file", "held_out_split", "calibration_batch"]


def read_text(path: str | Path, argument: str = "calib") -> str:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{argument}={str(path)!r}: file does not exist")
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError(f"{argument}={str(path)!r}: the text file is empty; it must contain text to tokenize")
    return text


def tokenize_file(tokenizer, path: str | Path, argument: str = "calib") -> torch.Tensor:
    """All tokens of a text file, without special tokens. Returns [num_tokens] int64."""
    ids = tokenizer(read_text(path, argument), add_special_tokens=False, return_tensors="pt").input_ids[0]
    if ids.numel() < 2:
        raise ValueError(f"{argument}={str(path)!r}: {ids.numel()} token(s); need at least 2")
    return ids


def held_out_split(token_ids: torch.Tensor, calib_fraction: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibrate on the first part of one token stream and evaluate on the rest: no token is in both."""
    if not 0.0 < calib_fraction < 1.0:
        raise ValueError(f"calib_fraction={calib_fraction} must be in (0, 1)")
    cut = int(token_ids.numel() * calib_fraction)
    return token_ids[:cut], token_ids[cut:]


def calibration_batch(token_ids: torch.Tensor, samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`samples` random non-overlapping windows of `seq_len` tokens from token_ids [num_tokens], fixed by seed.
    Returns [samples, seq_len]."""
    num_windows = token_ids.numel() // seq_len
    if num_windows < samples:
        raise ValueError(f"calibration text has {token_ids.numel()} tokens: {num_windows} windows of seq_len="
                         f"{seq_len}, but samples={samples} were requested; lower --samples or --seq-len")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randperm(num_windows, generator=generator)[:samples].sort().values
    windows = token_ids[: num_windows * seq_len].reshape(num_windows, seq_len)
    return windows[picks].clone()
