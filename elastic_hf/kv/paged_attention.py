"""The paged attention function, registered with transformers' AttentionInterface so the HF model's own forward
runs unchanged and calls us for every attention layer. No mask function is registered with AttentionMaskInterface on
purpose: for an attention implementation without one, HF's mask preparation returns None at once. With one, it first
looks for packed sequences in the position ids, which ends in a `bool(tensor)`: a device sync every step on a GPU, and
an error inside CUDA graph capture. Causality and sequence boundaries live in the PagedBatch; no dense mask is ever
built."""
from __future__ import annotations

import torch

from elastic_hf.kv.paged_batch import PagedBatch

ATTN_IMPLEMENTATION = "elastic_paged"


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, paged_batch: PagedBatch | None = None, **kwargs):
    """query: [1, num_heads, T, head_dim]; key/value: [1, num_kv_heads, T, head_dim] for T packed new tokens.
    Returns ([1, T, num_heads, head_dim], None): the step's attention backend (chosen when the instance was built,
    kv/attention_backends.py) does the work."""
    if paged_batch is None:
        raise RuntimeError("attn_implementation='elastic_paged' needs the engine's paged_batch; run this model "
                           "through ElasticModel, not directly")
    return paged_batch.backend.forward(module, query, key, value, scaling, paged_batch), None


def register_paged_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    return ATTN_IMPLEMENTATION
