"""Where elastic-hf keeps files of its own: the user cache directory (converted GGUF checkpoints, compiled C kernels,
quantized layer variants) and the data files shipped inside the package (calibration text, see data/NOTICE.md).
Nothing at run or test time reads outside the installed package and this cache."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DATA_DIR = Path(__file__).resolve().parent / "data"
CALIBRATION_TEXT = "wikitext2-valid.txt"   # WikiText-2 validation split, CC BY-SA 3.0 (data/NOTICE.md)


def cache_root() -> Path:
    """$ELASTIC_HF_CACHE, else $XDG_CACHE_HOME/elastic-hf, else ~/.cache/elastic-hf."""
    base = os.environ.get("ELASTIC_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "elastic-hf")
    return Path(base)


def package_data_file(name: str) -> Path:
    """A data file shipped in elastic_hf/data (installed with the package)."""
    path = PACKAGE_DATA_DIR / name
    if not path.is_file():
        shipped = sorted(p.name for p in PACKAGE_DATA_DIR.glob("*")) if PACKAGE_DATA_DIR.is_dir() else []
        raise FileNotFoundError(f"{name} is not among the package's data files {shipped}; reinstall elastic-hf")
    return path


def default_calibration_text() -> Path:
    """The calibration text of `elastic-hf profile` and AWQ when none is given."""
    return package_data_file(CALIBRATION_TEXT)


def describe_data_path(path: Path) -> str:
    """How a profile or log names a text file: the package-relative name for a file shipped in elastic_hf/data (so
    a committed profile does not record the path of the machine that made it), the path as given otherwise."""
    try:
        return f"elastic_hf/data/{Path(path).resolve().relative_to(PACKAGE_DATA_DIR)}"
    except ValueError:
        return str(path)
