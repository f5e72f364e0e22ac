"""Where elastic-hf keeps files of its own: the user cache directory (converted GGUF checkpoints, compiled C kernels,
quantized layer variants) and the data files shipped inside the package (calibration text, see data/NOTICE.md).
Nothing at run or test time reads outside the installed package and this cache."""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE_DATA_DIR = Path(__file__).resolve().parent / "data"
CALIBRATION_TEXT = "wikitext2-valid.txt"   # WikiText-2 validation split, CC BY-SA 3.0 (data/NOTICE.md)


def cache_root() -> Path:
    """$ELASTIC_HF_CACHE, else $XDG_CACHE_HOME/elastic-hf, else ~/.cache/elastic-hf."""
    base = os.environ.get("ELASTIC_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "elastic-hf")
    return Path(base)


def is_private(path: Path) -> bool:
    """Owned by this user and writable by no one else: what may hold code we load (compiled kernels) and weights
    we serve. A cache that others can write to would let them run code in the server."""
    info = path.lstat()
    return info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def trusted_cache_dir(sub: str) -> Path:
    """cache_root()/sub, created private (0700) where missing. Where the cache root or `sub` exists but is not
    private (another owner, group- or world-writable, a symlink), a private directory of this user under the
    system's temporary directory is used instead, with a warning once."""
    root = cache_root()
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = root / sub
        path.mkdir(exist_ok=True, mode=0o700)
        if not path.is_symlink() and is_private(root) and is_private(path):
            return path
        reason = f"{root} or {path} is a symlink, not yours, or writable by others"
    except OSError as exc:
        reason = f"{root} is not usable: {exc}"
    return _fallback_dir(reason) / sub


@functools.cache
def _fallback_dir(reason: str) -> Path:
    base = Path(tempfile.gettempdir()) / f"elastic-hf-{os.getuid()}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        if base.is_symlink() or not is_private(base):
            raise PermissionError(f"{base} is not private")
    except OSError:
        base = Path(tempfile.mkdtemp(prefix="elastic-hf-"))   # fresh, 0700, ours: nothing cached survives it
    log.warning("the elastic-hf cache is not private (%s): caching in %s instead; set ELASTIC_HF_CACHE to a "
                "directory only you can write", reason, base)
    for sub in ("gguf", "native", "morph-variants"):
        (base / sub).mkdir(mode=0o700, exist_ok=True)
    return base


@functools.lru_cache(maxsize=256)
def _digest(path: str, size: int, mtime_ns: int, inode: int) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:16]


def file_content_key(path: str | Path) -> str:
    """sha256 of a file's bytes (16 hex digits): caches keyed by it serve stale data neither after a file is
    replaced with one of the same size and mtime nor miss a copy of the same file. Hashed once per process while the
    file's stat is unchanged (~0.1 s per 100 MB)."""
    info = Path(path).stat()
    return _digest(str(Path(path).resolve()), info.st_size, info.st_mtime_ns, info.st_ino)


def private_temp_dir(parent: Path, name: str) -> Path:
    """A new 0700 directory in `parent` to build a cache entry in before renaming it into place (mkdtemp: a name
    nobody can predict or pre-create as a symlink). Its name carries this process's id, so sweep_stale_temps can
    remove what a crashed process left."""
    return Path(tempfile.mkdtemp(prefix=f"{name}.tmp{os.getpid()}-", dir=parent))


def sweep_stale_temps(parent: Path) -> None:
    """Remove temporary build directories whose process is gone (a crash mid-conversion would otherwise leave a
    multi-GB directory behind)."""
    for path in parent.glob("*.tmp*-*"):
        pid = path.name.rpartition(".tmp")[2].partition("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def publish_dir(tmp: Path, target: Path) -> Path:
    """Rename a finished temporary directory into place; when another process published the same entry first,
    keep theirs and drop ours (concurrent first starts on one file all succeed)."""
    try:
        tmp.rename(target)
    except OSError:
        if not target.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return target


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
