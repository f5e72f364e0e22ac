"""Fixtures for the quantized-layer tests: tiny random Llama/Qwen2 layers and (slow) the default model."""
from __future__ import annotations

import pytest
import torch


def tiny_config(model_type: str = "llama", num_layers: int = 2, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, vocab: int = 256):
    if model_type == "qwen2":
        from transformers import Qwen2Config as Config
    else:
        from transformers import LlamaConfig as Config
    return Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                  num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=512, tie_word_embeddings=True)


def tiny_model(model_type: str = "llama", seed: int = 0, **kwargs):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    config = tiny_config(model_type, **kwargs)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config).eval().requires_grad_(False)
    if model_type == "qwen2":  # random init leaves biases at zero; make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_(0, 0.5)
    return model


@pytest.fixture
def make_tiny_model():
    """make_tiny_model("llama" | "qwen2", seed=0, **shape) -> a tiny random-weight HF model (eval, no grad)."""
    return tiny_model


@pytest.fixture(scope="session")
def hf_default_model():
    """(HF model, tokenizer, ResolvedModel) of the embedded default model, loaded once for this folder."""
    from elastic_hf.model.loader import load_model_and_tokenizer
    model, tokenizer, resolved = load_model_and_tokenizer()
    return model, tokenizer, resolved


@pytest.fixture(scope="session")
def wikitext_path():
    from elastic_hf.morph.profile_cmd import find_data_file
    try:
        return find_data_file()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
