"""Shared helpers of the morph tests: tiny morph-enabled models and weight snapshots."""
from __future__ import annotations

import torch

from elastic_hf import ElasticModel


def tiny_morph_model(checkpoint, morph="manual", kv_cache_memory=2 << 20, controller=None, profile=None, **options):
    return ElasticModel.from_pretrained(checkpoint, kv_cache_memory=kv_cache_memory, morph=morph, profile=profile,
                                        morph_options={"use_cache": False, "controller": controller or {}},
                                        **options)


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.worker.hf_model.named_parameters()}


def assert_bit_identical(model, reference: dict[str, torch.Tensor]) -> None:
    params = dict(model.worker.hf_model.named_parameters())
    assert params.keys() == reference.keys()
    for name, p in params.items():
        assert torch.equal(p, reference[name]), f"{name} differs after the round trip"
