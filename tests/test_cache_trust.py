"""The caches hold code we load (compiled kernels) and weights we serve, so they must be private: a cache that
is group- or world-writable (or a symlink) is not used; a cached kernel that is not this user's private file is
rebuilt rather than loaded; entries are keyed by content; temporaries are unpredictable names; a concurrent first
start keeps the winner's entry instead of failing; a crash's leftovers are swept."""
import os
import subprocess
import sys

import pytest

from elastic_hf import paths


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ELASTIC_HF_CACHE", str(root))
    paths._fallback_dir.cache_clear()
    yield root
    paths._fallback_dir.cache_clear()


def test_a_shared_cache_is_not_used(cache, caplog):
    assert paths.trusted_cache_dir("gguf") == cache / "gguf" and oct(cache.stat().st_mode & 0o777) == "0o700"
    os.chmod(cache, 0o777)                      # e.g. ELASTIC_HF_CACHE on a shared directory
    with caplog.at_level("WARNING", logger="elastic_hf.paths"):
        private = paths.trusted_cache_dir("gguf")
    assert cache not in private.parents and paths.is_private(private.parent)
    assert "not private" in caplog.text and str(cache) in caplog.text
    os.chmod(cache, 0o700)
    (cache / "native").mkdir(mode=0o700, exist_ok=True)
    os.chmod(cache / "native", 0o770)          # a group-writable sub-directory counts as well
    assert cache not in paths.trusted_cache_dir("native").parents


def test_a_cached_kernel_someone_else_could_write_is_rebuilt(cache):
    code = ("import os, sys\n"
            "from elastic_hf.native.build import load_library\n"
            "lib = load_library('argmax')\n"
            "print(lib._name if lib is not None else 'none')\n")
    env = {**os.environ, "ELASTIC_HF_CACHE": str(cache)}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if first.stdout.strip() == "none":
        pytest.skip("no C compiler: native kernels are not built here")
    built = first.stdout.strip()
    os.chmod(built, 0o666)                      # now anyone could have replaced its code
    stamp = os.stat(built).st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert again.stdout.strip() == built and "rebuilding it" in again.stderr
    assert paths.is_private(type(cache)(built)) and os.stat(built).st_mtime_ns != stamp


def test_content_keys_temporaries_and_publishing(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(b"x" * 1000)
    b.write_bytes(b"x" * 1000)
    assert paths.file_content_key(a) == paths.file_content_key(b)   # same content, other path
    b.write_bytes(b"y" * 1000)
    os.utime(b, ns=(a.stat().st_atime_ns, a.stat().st_mtime_ns))    # same size and mtime, other bytes
    assert paths.file_content_key(a) != paths.file_content_key(b)
    first = paths.private_temp_dir(tmp_path, "entry")
    second = paths.private_temp_dir(tmp_path, "entry")
    assert first != second and oct(first.stat().st_mode & 0o777) == "0o700"
    (first / "model.safetensors").write_text("theirs")
    (second / "model.safetensors").write_text("ours")
    target = tmp_path / "entry"
    assert paths.publish_dir(first, target) == target
    assert paths.publish_dir(second, target) == target                # the loser keeps the winner's entry
    assert (target / "model.safetensors").read_text() == "theirs" and not second.exists()
    crashed = tmp_path / "entry.tmp999999999-abc"                     # a process that no longer exists
    crashed.mkdir()
    mine = paths.private_temp_dir(tmp_path, "other")                  # this process: still building
    paths.sweep_stale_temps(tmp_path)
    assert not crashed.exists() and mine.exists()
