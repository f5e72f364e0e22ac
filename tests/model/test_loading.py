"""Model sources, architecture adapters, the GGUF cache, and weights living in the budgeted arena."""
import time

import pytest
import torch

from elastic_hf import ElasticModel
from elastic_hf.model.loader import load_hf_model, resolve_model


def test_unknown_architecture_names_the_supported_ones(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2' is not supported; supported model types: llama, mistral, qwen2"):
        ElasticModel.from_pretrained(tmp_path)


def test_missing_model_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local checkpoint directory nor a .gguf file"):
        ElasticModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        ElasticModel.from_pretrained(tmp_path)


@pytest.mark.slow
def test_default_gguf_is_converted_once_and_reloads_fast():
    first = resolve_model(None)  # converts on a fresh machine, reuses the cache afterwards
    stamp = (first.checkpoint_dir / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = resolve_model(None)
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
