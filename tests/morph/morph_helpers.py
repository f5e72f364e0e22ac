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


def weights_read(module) -> dict[str, torch.Tensor]:
    """Every tensor the forward of `module` reads, by name: its parameters, where a linear packed in place
    (layers/packed_linear.py) has a meta `weight`, its packed bytes instead (views of the same arena range)."""
    tensors = {name: p for name, p in module.named_parameters() if not p.is_meta}
    for name, sub in module.named_modules():
        fused = getattr(sub, "fused", None)
        packed = fused.packed_weight if fused is not None else getattr(sub, "packed_weight", None)
        if packed is not None and not packed.is_mkldnn:
            tensors[f"{name}.packed_weight"] = packed
    return tensors


def snapshot(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in weights_read(model.worker.hf_model).items()}


def assert_bit_identical(model, reference: dict[str, torch.Tensor]) -> None:
    tensors = weights_read(model.worker.hf_model)
    assert tensors.keys() == reference.keys()
    for name, t in tensors.items():
        assert torch.equal(t, reference[name]), f"{name} differs after the round trip"


def packed_outside_arena_bytes(model) -> int:
    """Bytes of the oneDNN-packed weights (the LM head), which live in the CPU allocator, not the weights arena:
    the ledger's weights are the arena's committed bytes plus these."""
    tensors = {id(t): t for t in (getattr(m, "packed_weight", None) for m in model.worker.hf_model.modules())
               if t is not None and t.is_mkldnn}
    return sum(int(torch.ops.mkldnn._nbytes(t)) for t in tensors.values())
