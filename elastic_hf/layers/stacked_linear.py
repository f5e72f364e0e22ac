"""Linears that read one input (a layer's q/k/v, its gate/up) as one GEMM over a view of their weights where the
arena already holds them back to back, no copy: vLLM's QKVParallelLinear / MergedColumnParallelLinear without a
second weight. The weights arena places a layer's parameters in module order at TENSOR_ALIGNMENT
(model/weight_placement.py), so q, k and v (and gate, up) are adjacent whenever they have no bias between them and
their byte sizes are multiples of the alignment: a [sum(out), in] view from q's first byte is the stacked weight.

Where it pays: on CUDA a batch-1 decode step is a chain of small kernels (504 for the default model's 30 layers,
docs/GPU.md), and the group's three (two) GEMMs become one. The members become FusedMemberLinear over a plain
FusedProduct (layers/packed_linear.py): HF's forward calls q_proj, k_proj and v_proj in turn and each gets its
column range of the one product; the fused decoder layer and the MLPs take the product whole. The plain weights
stay what they were (views of the same bytes), so memory does not change. Like packing, it is for one worker
(EngineConfig.packed_weights); on a morphing CPU instance it takes the groups that could not pack in place."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.packed_linear import FusedProduct, make_members


def stackable(group: list[nn.Module]) -> bool:
    """Plain linears (nn.Linear, not quantized, sharded or packed) of one dtype, device and input size, without
    biases, whose weights are contiguous and lie back to back in memory in the group's order."""
    if len(group) < 2 or any(type(m) is not nn.Linear or m.bias is not None for m in group):
        return False
    first = group[0].weight
    end = first.data_ptr()
    for m in group:
        w = m.weight
        if (w.dtype != first.dtype or w.device != first.device or w.shape[1] != first.shape[1]
                or not w.is_contiguous() or w.data_ptr() != end):
            return False
        end += w.numel() * w.element_size()
    return True


def stack_fused(group: list[nn.Linear], stacked: torch.Tensor) -> None:
    """Switch every member of a stackable group to FusedMemberLinear over one product whose weight is `stacked`, a
    [sum(out_features), in_features] view over the members' own bytes (from the first one's), in place."""
    rows, cols = sum(m.out_features for m in group), group[0].in_features
    first = group[0].weight
    if tuple(stacked.shape) != (rows, cols) or stacked.data_ptr() != first.data_ptr() or stacked.dtype != first.dtype:
        raise ValueError(f"the stacked weight must be a [{rows}, {cols}] {first.dtype} view from the first member's "
                         f"weight, got {tuple(stacked.shape)} {stacked.dtype}")
    make_members(group, FusedProduct(stacked, None, len(group), packed=False))
