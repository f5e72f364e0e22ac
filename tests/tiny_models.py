"""Tiny random-weight checkpoints (Llama, Qwen2, Mistral) with the default model's real tokenizer, saved once
per test session. Weights use a larger init scale than HF's default so greedy choices have clear margins and
exactness tests compare model behaviour, not float round-off between near-equal logits."""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

TINY_SHAPES = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=1024)


def _config(arch: str, shape: dict):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(TINY_SHAPES, **shape, vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=False, initializer_range=0.2)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)  # q/k/v carry biases
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=24)  # small window: exercised by long prompts
    raise ValueError(arch)


def build_tiny_checkpoint(arch: str, out_dir: Path, seed: int = 0, **shape) -> Path:
    """shape overrides TINY_SHAPES (hidden_size, num_key_value_heads, ...)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch, shape), dtype=torch.float32)
    with torch.no_grad():  # biases default to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir).save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir
