"""Compiles the package's C kernels with the machine's C compiler on first use and loads them with ctypes.

Why C through ctypes rather than a torch C++ extension: these kernels take raw pointers and need no torch headers,
so a build takes well under a second instead of a minute of compiling ATen headers, and nothing has to be built
at install time. The shared library is cached under the elastic-hf cache dir, keyed by the source, the compiler,
the flags and the CPU's instruction-set flags (it is built with -march=native), and written atomically so several
processes (tensor-parallel workers) can build it at once.

OpenMP: the kernels are linked against the OpenMP runtime torch has already loaded (found in /proc/self/maps, e.g.
torch/lib/libgomp.so.1 or a wheel's renamed libgomp-<hash>.so.1), so the dynamic loader binds them to torch's own
thread pool instead of loading a second runtime whose idle threads would spin against torch's.

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

from elastic_hf.paths import is_private, trusted_cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent
CFLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-std=c11")
# Per-library additions. paged_decode: -funsafe-math-optimizations lets its exp polynomial and reductions vectorise
# (~1.7x); unlike -ffast-math it keeps infinities and NaNs meaningful.
EXTRA_CFLAGS = {"paged_decode": ("-funsafe-math-optimizations",),
                "causal_prefill": ("-funsafe-math-optimizations", "-mprefer-vector-width=512"),
                "fused_elementwise": ("-funsafe-math-optimizations", "-mprefer-vector-width=512"),
                # rotary must equal eager torch bit for bit: no FMA contraction, no fast-math
                "rotary": ("-ffp-contract=off", "-mprefer-vector-width=512")}


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


def _loaded_openmp_runtime() -> str | None:
    """Path of the OpenMP runtime (libgomp) mapped into this process by torch, if any."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if os.path.basename(path).startswith("libgomp") and ".so" in path and os.path.exists(path):
            return path
    return None


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(source: Path, compiler: str) -> Path:
    # the key covers the package's headers too: a kernel's source includes them
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    flags = CFLAGS + EXTRA_CFLAGS.get(source.stem, ())
    openmp = _loaded_openmp_runtime()
    # torch's runtime by path (its SONAME becomes the dependency); else the compiler's own -fopenmp link
    link = [openmp, f"-Wl,-rpath,{os.path.dirname(openmp)}"] if openmp else ["-fopenmp"]
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(text + version.encode() + " ".join(flags + tuple(link)).encode()
                         + _cpu_flags().encode()).hexdigest()
    out_dir = trusted_cache_dir("native")
    target = out_dir / f"{source.stem}-{key[:16]}.so"
    if target.exists():
        if not target.is_symlink() and is_private(target):
            return target
        # loading it would run whatever someone else put there: replace it with our own build
        logger.warning("%s is not this user's private file; rebuilding it", target)
        target.unlink()
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    obj = tmp[:-3] + ".o"
    try:
        for cmd in ([compiler, *flags, "-c", "-o", obj, str(source)],
                    [compiler, "-shared", "-o", tmp, obj, *link, "-lm"]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent builder either sees nothing or the finished library
    finally:
        for path in (tmp, obj):
            if os.path.exists(path):
                os.unlink(path)
    return target


def build_source(source: Path) -> ctypes.CDLL:
    """Compile (or take from the cache) and load one kernel source: the package's own (load_library) or a copy kept
    elsewhere beside its headers (another revision's `<name>.c`: benchmarks/kernel_ab.py), with the same flags and
    OpenMP runtime. Raises RuntimeError without a C compiler or when the build fails."""
    import torch  # noqa: F401  (maps torch's OpenMP runtime, which the build links against)

    compiler = _compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    return ctypes.CDLL(str(_build(Path(source), compiler)))


def bind(name: str, symbol: str, argtypes: list, restype=None):
    """The C function `symbol` of the compiled `<name>.c` with its ctypes signature set, or None where native
    kernels are off or cannot be built here (load_library warns once)."""
    lib = load_library(name)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


@cache
def load_library(name: str) -> ctypes.CDLL | None:
    """The compiled `<name>.c` of this package, or None (with a warning once) when native kernels are disabled
    or cannot be built here."""
    if not native_enabled():
        return None
    try:
        return build_source(SOURCE_DIR / f"{name}.c")
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        logger.warning("native kernel %s unavailable, using the pure-torch path: %s", name, exc)
        return None
