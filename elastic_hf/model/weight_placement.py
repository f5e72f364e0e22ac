"""Move a built HF model's parameters into a weights arena: every decoder layer gets its own page-aligned range,
and the parameters become zero-copy views of it.

A decoder layer's range is `[quant slots | fp region]`. The fp region holds the full-precision parameters and is
committed at load. The quant slots (one per quantized precision, e.g. "w4" and "w8", each page-aligned and sized
for that variant) are reserved virtual space only: a precision morph commits a slot, copies the variant into it,
switches the layer to it and decommits the fp region, so the freed pages can become KV blocks. One slot per
precision (not one shared slot) lets a W8 layer move to W4 without ever writing over the bytes a forward pass is
reading and without a detour through full precision. Without slots (`slot_bytes=None`) the layout is the plain
one of a model that never morphs.

`PlacedWeights` is the weights object of a single-worker instance; a tensor-parallel worker uses
parallel/shard_transform.ShardedWeights instead. Both implement `WeightLayout`: committed bytes, the replicated
bytes, the bytes of a TP shard, and (for precision morphing) each layer's fp region and quant slots. Callers depend
on that protocol, never on which class they hold."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from elastic_hf.layers.packed_linear import (fusable, meta_parameter, pack_fused, pack_group_in_place,
                                             pack_linear, pack_linear_in_place, packs_in_place, takes_packing,
                                             takes_packing_in_place)
from elastic_hf.layers.quant_linear import is_quant_linear
from elastic_hf.layers.stacked_linear import stack_fused, stackable
from elastic_hf.memory import MemoryBudget, create_arena
from elastic_hf.memory.arena import PageArena
from elastic_hf.units import round_up


@dataclass(slots=True)
class ArenaRange:
    offset: int
    nbytes: int          # page-aligned extent
    payload_bytes: int   # bytes the tensors use


@dataclass(slots=True)
class WeightPlacement:
    shared: ArenaRange                                      # embeddings, final norm, untied LM head
    layers: list[ArenaRange] = field(default_factory=list)  # the fp region of each decoder layer
    # Per decoder layer: precision name -> reserved quant slot (uncommitted until a morph uses it).
    slots: list[dict[str, ArenaRange]] = field(default_factory=list)

    @property
    def committed_bytes(self) -> int:
        """Bytes committed at load (shared range + every fp region); morphs change what the arena holds later."""
        return self.shared.nbytes + sum(r.nbytes for r in self.layers)


def _unique_params(module: nn.Module, exclude: set[int]) -> list[nn.Parameter]:
    """Its parameters, and the buffers of its quantized Linears (a pre-quantized checkpoint's W4 layers hold
    their weights as buffers): the tensors the arena must hold and the budget must count."""
    params = []
    quantized = [t for m in module.modules() if is_quant_linear(m) for t in m.buffers(recurse=False)]
    for p in [*module.parameters(), *quantized]:
        if id(p) not in exclude:
            exclude.add(id(p))
            params.append(p)
    return params


def param_groups(model: nn.Module, layers: nn.ModuleList) -> tuple[list[nn.Parameter], list[list[nn.Parameter]]]:
    """(shared params, params of each decoder layer), each parameter once: the layers claim theirs first, the
    shared range gets what is left (embeddings, final norm, LM head if untied)."""
    seen: set[int] = set()
    layer_params = [_unique_params(layer, seen) for layer in layers]
    return _unique_params(model, seen), layer_params


TENSOR_ALIGNMENT = 64  # every tensor starts on a cache line (and on any dtype's itemsize)
# A morphing instance's layers are read in place, packed (PlacedWeights.pack_layers_in_place), and its fp regions
# start on a page: every tensor of a layer then starts on a page too (their sizes are multiples of 4 KiB), and
# native/decode_gemm.c streams page-aligned weights 8-10 % slower than the same bytes at any other page offset (the
# default model's packed linears at 16 bf16 rows, 2 threads: 18.4-19.1 ms page-aligned vs 16.5-17.4 ms at offsets
# 64, 1088 or 2048; session 50, benchmarks/RESULTS.md). Its fp regions therefore start their first tensor this far in.
MORPH_REGION_SKEW = 2048


def _region_skew(slot_bytes: list[dict[str, int]] | None) -> int:
    """Where a layer's fp region puts its first tensor: MORPH_REGION_SKEW in a morphing instance (quant slots)."""
    return MORPH_REGION_SKEW if slot_bytes is not None else 0


def param_range_bytes(params: list[nn.Parameter]) -> int:
    """Bytes of `params` packed back to back at TENSOR_ALIGNMENT."""
    return sum(round_up(p.numel() * p.element_size(), TENSOR_ALIGNMENT) for p in params)


def _round_up(nbytes: int, page_size: int) -> int:
    return round_up(max(nbytes, 1), page_size)  # an empty range still gets its own page


def _slot_extent(slot_bytes: dict[str, int] | None, page_size: int) -> int:
    return sum(_round_up(n, page_size) for n in (slot_bytes or {}).values())


def weights_capacity_bytes(model: nn.Module, layers: nn.ModuleList, page_size: int,
                           slot_bytes: list[dict[str, int]] | None = None) -> int:
    """Arena bytes needed: the shared range plus, per layer, its quant slots and its page-rounded fp region.
    slot_bytes[i] maps a precision name to the payload bytes of layer i's variant."""
    shared_params, layer_params = param_groups(model, layers)
    total = _round_up(param_range_bytes(shared_params), page_size)
    skew = _region_skew(slot_bytes)
    for i, params in enumerate(layer_params):
        total += _slot_extent(slot_bytes[i] if slot_bytes else None, page_size)
        total += _round_up(skew + param_range_bytes(params), page_size)
    return total


def place_params(params: list[nn.Parameter], arena: PageArena, offset: int, skew: int = 0) -> ArenaRange:
    """Commit a page-rounded range at `offset` and make `params` zero-copy views of it (their values copied), the
    first `skew` bytes in (zeros, part of the range's payload)."""
    payload = skew + param_range_bytes(params)
    nbytes = _round_up(payload, arena.page_size)
    arena.commit(offset, nbytes)
    cursor = offset + skew
    for p in params:
        view = arena.view(cursor, tuple(p.shape), p.dtype)
        view.copy_(p.data)
        p.data = view
        cursor += round_up(p.numel() * p.element_size(), TENSOR_ALIGNMENT)
    return ArenaRange(offset, nbytes, payload)


@torch.no_grad()
def place_weights(model: nn.Module, layers: nn.ModuleList, arena: PageArena,
                  slot_bytes: list[dict[str, int]] | None = None) -> WeightPlacement:
    if slot_bytes is not None and len(slot_bytes) != len(layers):
        raise ValueError(f"slot_bytes has {len(slot_bytes)} entries for {len(layers)} decoder layers")
    shared_params, layer_params = param_groups(model, layers)
    shared = place_params(shared_params, arena, 0)
    placement = WeightPlacement(shared)
    offset = shared.nbytes
    for i, params in enumerate(layer_params):
        slots: dict[str, ArenaRange] = {}
        for precision, payload in (slot_bytes[i] if slot_bytes else {}).items():
            extent = _round_up(payload, arena.page_size)
            slots[precision] = ArenaRange(offset, extent, payload)  # reserved, not committed
            offset += extent
        r = place_params(params, arena, offset, _region_skew(slot_bytes))
        placement.layers.append(r)
        placement.slots.append(slots)
        offset += r.nbytes
    for slots in placement.slots:
        for slot in slots.values():
            # With transparent huge pages, faulting in an fp region also faulted in the rest of its 2 MiB huge
            # page, i.e. parts of the neighbouring (uncommitted) slots. Hand those zero pages back so resident
            # memory matches the ledger; a slot is committed (and charged) only by a morph.
            arena.commit(slot.offset, slot.nbytes)
            arena.decommit(slot.offset, slot.nbytes)
    return placement


class WeightLayout(Protocol):
    """What a worker's weights answer, placed whole (PlacedWeights) or as a TP/PP shard (ShardedWeights)."""
    arena: PageArena

    @property
    def committed_bytes(self) -> int: ...

    @property
    def shared_bytes(self) -> int:
        """Committed bytes of the replicated weights (embeddings, final norm, untied LM head)."""
        ...

    def shard_bytes(self, tp: int, rank: int, layers: tuple[int, int] | None = None) -> int: ...

    def fp_region(self, layer: int) -> ArenaRange: ...

    def slot(self, layer: int, precision: str) -> ArenaRange: ...


class PlacedWeights:
    """The weights of a single-worker instance in one arena: a shared range plus one page-aligned range per decoder
    layer (with reserved quant slots when the instance morphs)."""

    def __init__(self, arena: PageArena, placement: WeightPlacement):
        self.arena = arena
        self.placement = placement
        self.packed_extra_bytes = 0   # packed weights' bytes minus the arena pages they gave back (pack_linears)

    @classmethod
    def place(cls, model: nn.Module, layers: nn.ModuleList, budget: MemoryBudget, device: torch.device,
              page_size: int, slot_bytes: list[dict[str, int]] | None = None) -> "PlacedWeights":
        capacity = weights_capacity_bytes(model, layers, page_size, slot_bytes)
        # Transparent huge pages: weights are read in full every step (fewer TLB misses, faster load).
        arena = create_arena(device, capacity, budget, "weights", page_size, huge_pages=True)
        try:
            return cls(arena, place_weights(model, layers, arena, slot_bytes))
        except BaseException:
            arena.close()
            raise

    @property
    def committed_bytes(self) -> int:
        return self.arena.committed_bytes

    @property
    def shared_bytes(self) -> int:
        return self.placement.shared.nbytes

    def shard_bytes(self, tp: int, rank: int, layers: tuple[int, int] | None = None) -> int:
        """Committed bytes as shard (tp, rank): a single worker only runs TP1 over every layer, each fp region
        committed."""
        if (tp, rank) != (1, 0) or layers not in (None, (0, len(self.placement.layers))):
            raise ValueError(f"a single-worker instance runs all layers at TP1 only, got tp={tp} rank={rank} "
                             f"layers={layers}")
        return self.placement.committed_bytes + self.packed_extra_bytes

    @torch.no_grad()
    def pack_linears(self, model: nn.Module, fusion_groups: list[list[nn.Module]] = (),
                     exclude: nn.Module | None = None) -> int:
        """Switch every packable linear of `model` to oneDNN's prepacked layout (layers/packed_linear.py), decommit
        the arena pages that only packed weights covered, and charge the packed bytes to the ledger. A weight
        another module also reads (a tied LM head's embedding table) keeps its pages; its packed copy is extra.
        The plain weights that gave their pages back become meta tensors, so a stray read fails instead of
        silently faulting in zero pages. Each of `fusion_groups` that can (linears reading one input: q/k/v,
        gate/up) becomes one stacked packed weight and one GEMM. Linears inside `exclude` (a morphing instance's
        decoder layers, packed in place instead) stay as they are. Returns how many linears were packed."""
        groups = [g for g in fusion_groups if fusable(g)]
        fused = {id(m) for g in groups for m in g}
        excluded = {id(m) for m in exclude.modules()} if exclude is not None else set()
        linears = [m for m in model.modules() if id(m) in fused or (id(m) not in excluded and takes_packing(m))]
        packed = {id(m) for m in linears}
        shared = {id(p) for m in model.modules() if id(m) not in packed for p in m.parameters(recurse=False)}
        base = self.arena.view(0, (1,), torch.uint8).data_ptr()
        spans, charged = [], 0
        for group in groups:
            charged += pack_fused(group)
        for module in linears:
            weight = module.weight   # packing changes the class; the plain weight goes just below
            if id(module) not in fused:
                charged += pack_linear(module)
            if id(weight) not in shared:
                start = weight.data_ptr() - base
                spans.append((start, start + weight.numel() * weight.element_size()))
                module.weight = meta_parameter(weight)
        before = self.arena.committed_bytes
        for first, end in _whole_pages(spans, self.arena.page_size):
            self.arena.decommit(first, end - first)
        self.arena.budget.charge(self.arena.owner, charged)   # after the release: a sized budget nets out
        self.packed_extra_bytes += charged - (before - self.arena.committed_bytes)
        return len(linears)

    def pack_layers_in_place(self, layers: nn.ModuleList, fusion_groups: list[list[nn.Module]]) -> int:
        """A morphing instance's decoder-layer linears on packed weights without moving them (layers/packed_linear.py,
        "packed in place"): each stackable group (q/k/v, gate/up) and each other linear whose shape the native
        kernel reads gets its own arena bytes rewritten into the packed layout. Run before the morph store captures
        the fp images, so a restored layer gets the packed bytes back. The plain weights become meta tensors (a
        stray read of the permuted bytes as [out, in] would be silent garbage). Returns how many linears."""
        done: set[int] = set()
        for group in fusion_groups:
            if not stackable(group) or not packs_in_place(sum(m.out_features for m in group), group[0].in_features,
                                                          group[0].weight.dtype):
                continue
            pack_group_in_place(group, self._stacked_view(group))
            done.update(id(m) for m in group)
        for module in layers.modules():
            if id(module) not in done and takes_packing_in_place(module):
                pack_linear_in_place(module)
                done.add(id(module))
        for module in layers.modules():
            if id(module) in done:
                module.weight = meta_parameter(module.weight)
        return len(done)

    def stack_linears(self, fusion_groups: list[list[nn.Module]]) -> int:
        """Each of `fusion_groups` whose weights lie back to back in this arena (layers/stacked_linear.py) runs as
        one GEMM over a view spanning them: no copy, no memory change. Returns how many groups."""
        stacked = 0
        for group in fusion_groups:
            if not stackable(group):
                continue
            stack_fused(group, self._stacked_view(group))
            stacked += 1
        return stacked

    def _stacked_view(self, group: list[nn.Module]) -> torch.Tensor:
        """[sum(out), in] arena view over a stackable group's back-to-back weights, from the first member's byte."""
        first = group[0].weight
        base = self.arena.view(0, (1,), torch.uint8).data_ptr()
        return self.arena.view(first.data_ptr() - base, (sum(m.out_features for m in group), first.shape[1]),
                               first.dtype)

    def fp_region(self, layer: int) -> ArenaRange:
        return self.placement.layers[layer]

    def slot(self, layer: int, precision: str) -> ArenaRange:
        return self.placement.slots[layer][precision]


def _whole_pages(spans: list[tuple[int, int]], page_size: int) -> list[tuple[int, int]]:
    """The page-aligned ranges lying wholly inside the union of byte spans [start, end): a page that also holds a
    byte of anything else (a norm weight, a tied table) stays committed."""
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1] + TENSOR_ALIGNMENT:   # back to back up to the tensor alignment
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    pages = [(round_up(start, page_size), end // page_size * page_size) for start, end in merged]
    return [(first, end) for first, end in pages if end > first]
