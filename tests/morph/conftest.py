"""Fixtures for the LIS profiler / profile CLI tests: an in-memory tiny random Llama (4 layers, hidden 64)."""
from __future__ import annotations

import pytest
import torch


def build_tiny_llama(num_layers: int = 4, seed: int = 0, vocab: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, initializer_range=0.1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval().requires_grad_(False)


@pytest.fixture(scope="session")
def tiny_llama():
    """tiny_llama(num_layers=4, seed=0) -> a random-weight LlamaForCausalLM with hidden 64, GQA 4/2 heads."""
    return build_tiny_llama
