"""Tiny checkpoints shaped for tensor parallelism: 3 KV heads (TP2 splits them 2 + 1) with a wide MLP so that freed
shard pages show in RSS, and 4 KV heads for TP4. Deployments are module-scoped: starting worker processes costs
seconds (torch import), the tests reuse them and reshape them to the topology they need."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

TP_SHAPES = {
    # hidden 96 / 6 heads -> head_dim 16; 3 KV heads; MLP 3 x 96 x 1536 fp32 = 1.7 MiB per layer
    "kv3": dict(hidden_size=96, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=3),
    "kv4": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4),
}


def build_tp_checkpoint(shape: str, arch: str, out_dir: Path, seed: int = 0) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

    from elastic_hf.model.loader import resolve_model

    if (out_dir / "config.json").exists():
        return out_dir
    common = dict(TP_SHAPES[shape], vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                  tie_word_embeddings=False, initializer_range=0.2, max_position_embeddings=1024)
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.2)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir).save_pretrained(tmp)
    tmp.rename(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory):
    """tp_checkpoint("kv3" | "kv4", arch="llama" | "qwen2") -> checkpoint dir, built once per session."""
    root = tmp_path_factory.mktemp("tp-models")
    return lambda shape, arch="llama": build_tp_checkpoint(shape, arch, root / f"{shape}-{arch}")
