"""Tiny checkpoints shaped for tensor parallelism: 3 KV heads (TP2 splits them 2 + 1) with a wide MLP so that freed
shard pages show in RSS, and 4 KV heads for TP4. Deployments are module-scoped: starting worker processes costs
seconds (torch import), the tests reuse them and reshape them to the topology they need."""
from __future__ import annotations

from pathlib import Path

import pytest

TP_SHAPES = {
    # hidden 96 / 6 heads -> head_dim 16; 3 KV heads; MLP 3 x 96 x 1536 fp32 = 1.7 MiB per layer
    "kv3": dict(hidden_size=96, intermediate_size=1536, num_hidden_layers=3, num_attention_heads=6,
                num_key_value_heads=3),
    "kv4": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                num_key_value_heads=4),
}


def build_tp_checkpoint(shape: str, arch: str, out_dir: Path, seed: int = 0) -> Path:
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint(arch, out_dir, seed, **TP_SHAPES[shape])


@pytest.fixture(scope="session")
def tp_checkpoint(tmp_path_factory):
    """tp_checkpoint("kv3" | "kv4", arch="llama" | "qwen2") -> checkpoint dir, built once per session."""
    root = tmp_path_factory.mktemp("tp-models")
    return lambda shape, arch="llama": build_tp_checkpoint(shape, arch, root / f"{shape}-{arch}")
