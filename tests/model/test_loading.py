"""Model sources, architecture adapters, the GGUF cache, and weights living in the budgeted arena."""
import time

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.model.loader import load_hf_model, resolve_model


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local checkpoint directory, a .gguf file nor a Hub repo id"):
        ElasticModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        ElasticModel.from_pretrained(tmp_path)


@pytest.mark.slow
@pytest.mark.serial   # a wall-clock bound: beside another pytest worker it took 2.36 s once (session 67)
def test_default_gguf_is_converted_once_and_reloads_fast():
    first = resolve_model(None, dtype="float32")  # converts on a fresh machine, reuses the cache afterwards
    load_hf_model(first.checkpoint_dir)   # transformers imports its model and tokenizer modules on first use: ~3 s
    stamp = (first.checkpoint_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = resolve_model(None, dtype="float32")
    model, tokenizer = load_hf_model(again.checkpoint_dir)
    elapsed = time.perf_counter() - start
    assert again.checkpoint_dir == first.checkpoint_dir
    assert (again.checkpoint_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert model.config.num_hidden_layers == 30 and model.config.num_key_value_heads == 3
    assert elapsed < 2.0, f"cached load took {elapsed:.2f} s"


def test_weights_are_views_of_the_arena_and_ledger_adds_up(tiny_checkpoint):
    # Plain weights: prepacked ones live outside the arena (tests/layers/test_packed_linear.py checks those).
    model = ElasticModel.from_pretrained(tiny_checkpoint("qwen2"), kv_cache_memory=4 << 20, packed_weights="off")
    worker = model.worker
    arena = worker.weights.arena
    base = arena.view(0, (1,), torch.uint8).data_ptr()
    for name, p in worker.hf_model.named_parameters():
        offset = p.data_ptr() - base
        assert 0 <= offset < arena.capacity_bytes, f"{name} lives outside the weights arena"
    report = model.memory_report()
    assert report["weights_bytes"] == worker.weights.placement.committed_bytes == arena.committed_bytes
    assert report["kv_bytes"] == report["kv_blocks_total"] * report["kv_block_bytes"]
    assert report["weights_bytes"] + report["kv_bytes"] + report["free_bytes"] == report["budget_bytes"]
    for r in worker.weights.placement.layers:
        assert r.offset % arena.page_size == 0 and r.nbytes % arena.page_size == 0


def test_budget_too_small_for_weights_names_the_numbers(tiny_checkpoint):
    with pytest.raises(ValueError, match=r"leaves .* for the KV cache after .* of weights; one KV block needs"):
        ElasticModel.from_pretrained(tiny_checkpoint("llama"), memory_budget=1 << 20)


def test_max_model_len_beyond_kv_capacity_is_rejected(tiny_checkpoint):
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=128 << 10, max_model_len=1000)


_CONVERT_AND_MEASURE = """
import resource, sys, torch, transformers, gguf
from elastic_hf.model.loader import convert_gguf
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
out = convert_gguf(__import__("pathlib").Path(sys.argv[1]), torch.bfloat16)
print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, out)
"""


@pytest.mark.slow
def test_gguf_converts_straight_to_bf16_keyed_by_content(tmp_path, monkeypatch):
    """The default GGUF asked for in bf16: the peak RSS of the conversion stays below the bf16 model plus a whole
    fp32 copy (transformers de-quantizes one tensor at a time); a copy of the file elsewhere, with a new mtime,
    finds the same cache entry."""
    import os
    import shutil
    import subprocess
    import sys

    from elastic_hf.model.default_model import default_gguf_path

    env = {**os.environ, "ELASTIC_HF_CACHE": str(tmp_path / "cache")}
    base, peak, out = subprocess.run([sys.executable, "-c", _CONVERT_AND_MEASURE, str(default_gguf_path())], env=env,
                                     capture_output=True, text=True, timeout=600, check=True).stdout.split()
    bf16_bytes = os.path.getsize(os.path.join(out, "model.safetensors"))
    with __import__("safetensors").safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert int(peak) - int(base) < bf16_bytes + 2 * bf16_bytes, \
        f"conversion peak {int(peak) - int(base) >> 20} MiB over a {bf16_bytes >> 20} MiB bf16 model"
    stamp = os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns
    (tmp_path / "elsewhere").mkdir()
    copy = shutil.copy(default_gguf_path(), tmp_path / "elsewhere")   # same content, new path and mtime
    monkeypatch.setenv("ELASTIC_HF_CACHE", str(tmp_path / "cache"))
    assert str(resolve_model(copy, dtype="bfloat16").checkpoint_dir) == out
    assert os.stat(os.path.join(out, "model.safetensors")).st_mtime_ns == stamp   # found, not converted again
