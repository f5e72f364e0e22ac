"""The vocabulary tables a worker holds for its role: what a pipeline stage does not read goes back to the budget.

The input embedding and the LM head are [vocab, hidden] each (the default model ties them: one table of 108 MiB in
fp32, the bytes of 8 of its 30 decoder layers). A whole-model role uses both. In a pipeline (a static one, or a
parameter drop's group, KunServe §4.1: what a stage does not run is memory for the KV cache):
- the last stage runs the LM head: it holds the head (a tied table: the one table);
- the first stage embeds the step's token ids: unless it is also the last, it gathers those rows from the shared
  host weight store (layers/host_rows_embedding.py) and holds no table; where the store has no copy of the table
  or the embedding is not a plain lookup (Gemma's scaled rows), it keeps its own;
- every other stage receives hidden states: no embedding, no head.
Held tables count in the worker's weights (ShardedWeights.shard_bytes), so the KV capacity of a stage and the
layer split of a drop (engine/drop_plan.stage_split) see them: on the default model the first stage of 1x2 holds
16 layers in what 15 and the table took before, which balances the LM head's time on the last stage.

A table given back is refilled from the store when a role needs it again (a restore, a rollback), in its serving
layout: plain rows, or the native kernel's packed layout where the head was packed in place
(layers/packed_table.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elastic_hf.layers.host_rows_embedding import read_rows_from_arena, read_rows_from_host, reads_rows_from_host
from elastic_hf.layers.packed_linear import PackedLinear, meta_parameter
from elastic_hf.model.weight_placement import ArenaRange, param_range_bytes, place_params
from elastic_hf.native.decode_gemm import packed_layout
from elastic_hf.units import round_up

EMBED, HEAD = "embed_tokens", "lm_head"   # SharedWeightStore.TABLE_KEYS


@dataclass(slots=True)
class VocabTable:
    key: str                          # its SharedWeightStore table (a tied table: the embedding's)
    range: ArenaRange                 # its own pages of the weights arena
    shape: tuple[int, int]            # [vocab, hidden]
    dtype: torch.dtype
    modules: tuple[nn.Module, ...]    # the embedding and/or the head whose `weight` it is
    uses: frozenset[str]              # EMBED, HEAD: what it serves
    refillable: bool                  # the store has a copy to refill it from
    held: bool = True


class StageTables:
    def __init__(self, hf_model: nn.Module, arena, offset: int, store, device: torch.device):
        """Place the embedding and the (untied) head, each in its own pages from `offset` of `arena`. `store`: the
        shared host weight store (its tables refill these and feed a first stage's rows)."""
        self.arena, self.store, self.device = arena, store, device
        self.embedding = hf_model.get_input_embeddings()
        self.head = hf_model.get_output_embeddings()
        tied = self.head is not None and self.embedding is not None and self.head.weight is self.embedding.weight
        self.tables: list[VocabTable] = []
        placed = []
        if self.embedding is not None:
            placed.append((EMBED, (self.embedding, self.head) if tied else (self.embedding,),
                           frozenset({EMBED, HEAD}) if tied else frozenset({EMBED})))
        if self.head is not None and not tied:
            placed.append((HEAD, (self.head,), frozenset({HEAD})))
        for key, modules, uses in placed:
            weight = modules[0].weight
            table = self._source(key)
            refillable = table is not None and tuple(table.shape) == tuple(weight.shape)
            rng = place_params([weight], arena, offset)
            self.tables.append(VocabTable(key, rng, tuple(weight.shape), weight.dtype, modules, uses, refillable))
            offset += rng.nbytes
        # A first stage without its table reads rows from the store's copy, which must be the embedding's values.
        self.host_rows = self.embedding is not None and reads_rows_from_host(self.embedding, self._source(EMBED))

    @staticmethod
    def table_params(hf_model: nn.Module) -> list[nn.Parameter]:
        """The Parameters a StageTables places (the caller places every other replicated one): the embedding's
        weight and an untied head's."""
        params = []
        for module in (hf_model.get_input_embeddings(), hf_model.get_output_embeddings()):
            if module is not None and all(module.weight is not p for p in params):
                params.append(module.weight)
        return params

    @staticmethod
    def extent(hf_model: nn.Module, page_size: int) -> int:
        """Arena bytes the tables take: each on pages of its own."""
        return sum(round_up(param_range_bytes([p]), page_size) for p in StageTables.table_params(hf_model))

    def _source(self, key: str) -> torch.Tensor | None:
        return self.store.table(key)

    # ------------------------------------------------------------------ which tables a role holds
    def needed(self, table: VocabTable, layers: tuple[int, int] | None, num_layers: int) -> bool:
        """Whether a worker holding decoder layers [start, end) (None: all) keeps `table` in its arena."""
        start, end = layers if layers is not None else (0, num_layers)
        uses = set()
        if end == num_layers:
            uses.add(HEAD)
        if start == 0 and (end == num_layers or not self.host_rows):
            uses.add(EMBED)
        return bool(uses & table.uses) or not table.refillable

    def held_bytes(self, num_layers: int, *ranges: tuple[int, int] | None) -> int:
        """Arena bytes of the tables a role holding every one of `ranges` keeps (no range: those held now)."""
        if not ranges:
            return sum(t.range.nbytes for t in self.tables if t.held)
        return sum(t.range.nbytes for t in self.tables if all(self.needed(t, r, num_layers) for r in ranges))

    @property
    def total_bytes(self) -> int:
        return sum(t.range.nbytes for t in self.tables)

    # ------------------------------------------------------------------ switching
    def release(self, layers: tuple[int, int], num_layers: int) -> int:
        """Give back the tables a role of `layers` does not hold (a first stage's embedding then reads host rows).
        Returns the bytes released."""
        freed = 0
        for table in self.tables:
            if table.held and not self.needed(table, layers, num_layers):
                if EMBED in table.uses and layers[0] == 0:
                    read_rows_from_host(self.embedding, self._source(EMBED), self.device)
                meta = meta_parameter(table.modules[0].weight)   # a stray read fails instead of reading zeros
                for module in table.modules:
                    module.weight = meta                          # one Parameter: a tied table stays tied
                self.arena.decommit(table.range.offset, table.range.nbytes)
                table.held = False
                freed += table.range.nbytes
        return freed

    def preload(self, layers: tuple[int, int], num_layers: int) -> int:
        """Commit and refill, from the store, the tables a role of `layers` holds and this worker does not, without
        serving from them yet (a restore's prewarm; `apply` switches). Returns the bytes loaded."""
        loaded = 0
        for table in self.tables:
            if not table.held and self.needed(table, layers, num_layers):
                self._refill(table)
                loaded += table.range.nbytes
        return loaded

    def apply(self, layers: tuple[int, int], num_layers: int) -> tuple[int, int]:
        """Hold exactly the tables of a role of `layers`: release the others, refill the missing ones and serve
        from them. Returns (bytes loaded, bytes released)."""
        released = self.release(layers, num_layers)
        loaded = self.preload(layers, num_layers)
        self._point_embedding(layers)
        return loaded, released

    def _point_embedding(self, layers: tuple[int, int]) -> None:
        """The embedding reads the arena's table where it is held, else (a first stage) the store's rows; a later
        stage never calls it."""
        table = next((t for t in self.tables if EMBED in t.uses), None)
        if table is None:
            return
        if table.held:
            read_rows_from_arena(self.embedding)
        elif layers[0] == 0 and self.host_rows:
            read_rows_from_host(self.embedding, self._source(EMBED), self.device)

    def _refill(self, table: VocabTable) -> None:
        """Commit the table's pages and copy it from the store in the layout its modules read: the native kernel's
        where the head was packed in place (a tied embedding reads its rows out of those bytes too), plain rows
        otherwise."""
        rng = table.range
        self.arena.commit(rng.offset, rng.nbytes)
        numel = table.shape[0] * table.shape[1]
        flat = self.arena.view(rng.offset, (numel,), table.dtype)
        source = self._source(table.key)
        if HEAD in table.uses and isinstance(self.head, PackedLinear):
            # the packed head's handle (and a tied PackedEmbedding's `packed`) still point at these bytes
            flat.copy_(packed_layout(source.to(table.dtype)))
        else:
            flat.view(table.shape).copy_(source)
            weight = nn.Parameter(flat.view(table.shape), requires_grad=False)
            for module in table.modules:
                module.weight = weight
        table.held = True
