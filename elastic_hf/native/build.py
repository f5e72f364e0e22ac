"""Compiles the package's C kernels with the machine's C compiler on first use and loads them with ctypes.

Why C through ctypes rather than a torch C++ extension: these kernels take raw pointers and need no torch headers,
so a build takes well under a second instead of a minute of compiling ATen headers, and nothing has to be built
at install time. The shared library is cached under the elastic-hf cache dir, keyed by the source, the compiler,
the flags and the CPU's instruction-set flags (it is built with -march=native), and written atomically so several
processes (tensor-parallel workers) can build it at once.

OpenMP: the library needs `libgomp.so.1`, and torch's CPU wheel has already loaded its own copy under that soname,
so the dynamic loader binds the kernels to torch's OpenMP runtime (one thread pool, no oversubscription).

Set ELASTIC_HF_NATIVE=0 to never compile (the callers then keep their pure-torch paths)."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from elastic_hf.model.loader import cache_root

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared", "-std=c11")
# Per-library additions. paged_decode: -funsafe-math-optimizations lets its exp polynomial and reductions vectorise
# (~1.7x); unlike -ffast-math it keeps infinities and NaNs meaningful. rms_norm keeps strict IEEE order for its
# elementwise part, to round like the HF module.
EXTRA_CFLAGS = {"paged_decode": ("-funsafe-math-optimizations",)}


def native_enabled() -> bool:
    return os.environ.get("ELASTIC_HF_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(source: Path, compiler: str) -> Path:
    text = source.read_bytes()
    flags = CFLAGS + EXTRA_CFLAGS.get(source.stem, ())
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(text + version.encode() + " ".join(flags).encode() + _cpu_flags().encode()).hexdigest()
    out_dir = cache_root() / "native"
    target = out_dir / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {source.name} (exit {proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder either sees nothing or the finished library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled `<name>.c` of this package, or None (with a warning once) when native kernels are disabled
    or cannot be built here."""
    if not native_enabled():
        return None
    import torch  # noqa: F401  (loads torch's libgomp first, see the module docstring)

    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found (set CC); %s runs on the slower pure-torch path", name)
        return None
    try:
        return ctypes.CDLL(str(_build(SOURCE_DIR / f"{name}.c", compiler)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native kernel %s unavailable, using the pure-torch path: %s", name, exc)
        return None
