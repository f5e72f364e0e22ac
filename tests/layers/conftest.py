"""Fixtures for the quantized-layer tests: tiny random Llama/Qwen2 layers and (slow) the default model."""
from __future__ import annotations

import pytest


@pytest.fixture
def make_tiny_model():
    """make_tiny_model("llama" | "qwen2", seed=0, kv_heads=2) -> a 2-layer random-weight HF model (eval, no grad)."""
    from tiny_models import tiny_hf_model

    def make(arch: str = "llama", seed: int = 0, kv_heads: int = 2):
        return tiny_hf_model(arch, seed, bias_std=0.5, num_hidden_layers=2, num_key_value_heads=kv_heads,
                             vocab_size=256, max_position_embeddings=512, tie_word_embeddings=True,
                             initializer_range=0.02)
    return make


@pytest.fixture(scope="session")
def hf_default_model():
    """(HF model, tokenizer, ResolvedModel) of the embedded default model, loaded once for this folder."""
    from elastic_hf.model.loader import load_model_and_tokenizer
    model, tokenizer, resolved = load_model_and_tokenizer()
    return model, tokenizer, resolved


@pytest.fixture(scope="session")
def wikitext_path():
    from elastic_hf.profiling.calibration import default_calibration_text

    return default_calibration_text()
