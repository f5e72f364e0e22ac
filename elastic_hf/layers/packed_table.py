"""The LM head of a worker whose weights move (a TP / pipeline worker) on packed bytes in place, tied or not.

A static single worker gives its LM head oneDNN's packed copy (layers/packed_linear.py); a tied head keeps the plain
table beside it for the embedding lookup, one more table in memory (113 MB for the default model in fp32). Where
weights are re-cut by reshapes, layers go in and out with every drop and restore and the KV gets what the weights
leave, so a worker packs in its own arena bytes instead (layers/shardable_linear.py), and so does its head:
- untied: the head's weight is rewritten in place into native/decode_gemm.c's layout (pack_linear_in_place);
- tied: the one table is rewritten in place, the head reads it as a packed weight and the embedding reads its rows
  out of the packed layout (a gather of `hidden` values a token: a few microseconds a step).
At batch 1 in bf16 the head is the largest single product of a decode step (the default model: 49152 x 576, 2.2 ms
packed against 4.5 ms plain, layers/packed_linear.py's table)."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.packed_linear import meta_parameter, pack_linear_in_place, takes_packing_in_place
from elastic_hf.native.decode_gemm import packed_rows


class PackedEmbedding(nn.Embedding):
    """An nn.Embedding whose table is the flat packed bytes `packed` of its [num_embeddings, embedding_dim] weight
    (native/decode_gemm.packed_layout), shared with a tied PackedLinear head; its `weight` is a meta tensor."""

    packed: torch.Tensor

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [...] token ids -> [..., embedding_dim]: the rows of the plain table
        return packed_rows(self.packed, self.num_embeddings, self.embedding_dim, input_ids)


def _plain_embedding(module: nn.Module) -> bool:
    """nn.Embedding itself (not a subclass that scales or offsets rows, such as Gemma's), without max_norm (which
    renormalises rows of the table in place)."""
    return type(module) is nn.Embedding and module.max_norm is None


def pack_head_in_place(model: nn.Module) -> bool:
    """Switch `model`'s CPU LM head (and, when tied, its input embedding) to the packed layout in the head's own
    bytes; their `weight` Parameters become meta tensors. False (nothing changed) where the head does not take
    packing in place (layers/packed_linear.takes_packing_in_place: shape, dtype, bias) or a tied table's embedding
    is not a plain nn.Embedding."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or not takes_packing_in_place(head):
        return False
    tied = embedding is not None and embedding.weight is head.weight
    if tied and not _plain_embedding(embedding):
        return False
    pack_linear_in_place(head)
    head.weight = meta_parameter(head.weight)
    if tied:   # the embedding reads its rows out of the head's packed bytes; still one Parameter: tied
        embedding.packed = head.packed_weight
        embedding.__class__ = PackedEmbedding
        embedding.weight = head.weight
    return True
