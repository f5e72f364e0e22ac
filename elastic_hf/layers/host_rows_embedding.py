"""An input embedding that reads its rows from a host copy of the table instead of the worker's own arena.

A pipeline's first stage embeds token ids but runs no LM head; the vocabulary table is the largest single tensor of
a small model (the default model: 49,152 x 576, 108 MiB in fp32, as many bytes as 8 of its decoder layers). Where
the first stage gives that table back (parallel/stage_tables.py), its embedding gathers each step's rows from the
shared host weight store instead: T rows of `hidden` values a step (on a GPU they then cross to the device, T x
hidden x 2 bytes in bf16: a few microseconds). The lookup is the same F.embedding over the same values, so the
hidden states are bit-identical to the arena table's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastic_hf.layers.packed_table import PackedEmbedding


class HostRowsEmbedding(nn.Embedding):
    """An nn.Embedding whose forward reads `host_table` [num_embeddings, embedding_dim] (host memory, shared) and
    returns the rows on `rows_device`. `arena_class` is the class it serves as when its table is back in the
    arena (nn.Embedding or PackedEmbedding); its own `weight` is left as it was (a meta tensor while the table's
    pages are given back)."""

    host_table: torch.Tensor
    rows_device: torch.device
    arena_class: type

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [...] token ids -> [..., embedding_dim]
        rows = F.embedding(input_ids.to(self.host_table.device), self.host_table)
        return rows.to(self.rows_device, non_blocking=True)


def reads_rows_from_host(module: nn.Module, table: torch.Tensor | None) -> bool:
    """Whether `module` can read its rows from `table`: a plain lookup (nn.Embedding itself or its packed twin, no
    max_norm renormalising rows in place; not a subclass that scales rows, such as Gemma's) over a table of its
    shape and dtype."""
    return (table is not None and type(module) in (nn.Embedding, PackedEmbedding, HostRowsEmbedding)
            and module.max_norm is None
            and tuple(table.shape) == (module.num_embeddings, module.embedding_dim)
            and table.dtype == module.weight.dtype)


def read_rows_from_host(module: nn.Embedding, table: torch.Tensor, device: torch.device) -> None:
    """Switch `module` (reads_rows_from_host) to gather from `table`; undone by read_rows_from_arena."""
    if not reads_rows_from_host(module, table):
        raise ValueError(f"{type(module).__name__} [{module.num_embeddings}, {module.embedding_dim}] cannot read "
                         f"its rows from a {None if table is None else tuple(table.shape)} host table")
    if type(module) is not HostRowsEmbedding:
        module.arena_class = type(module)
        module.__class__ = HostRowsEmbedding
    module.host_table, module.rows_device = table, device


def read_rows_from_arena(module: nn.Module) -> None:
    """Back to the class it had before read_rows_from_host (its table is in the arena again); a no-op otherwise."""
    if type(module) is HostRowsEmbedding:
        module.__class__ = module.arena_class
        del module.host_table, module.rows_device, module.arena_class
