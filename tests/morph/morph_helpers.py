"""Shared helpers of the morph tests: tiny morph-enabled models and weight snapshots."""
from __future__ import annotations

import torch

from elastic_hf import ElasticModel


# A controller that morphs after 2 steps of a queue head waiting 1 ms for KV blocks (not 100 ms: independent of how
# fast a machine runs a step) and restores after 4 calm steps with no hold: the load tests' setting.
FAST_CONTROLLER = dict(persistence_steps=2, window_steps=2, queue_delay_threshold_s=1e-3,
                       restore_persistence_steps=4, restore_hold_s=0.0)


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
