"""Move a built HF model's parameters into a weights arena: every decoder layer gets its own page-aligned range,
and the parameters become zero-copy views of it. A precision morph later rewrites one layer's range in place
and decommits its tail pages, so each layer must own whole pages."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from elastic_hf.memory.arena import PageArena


@dataclass(slots=True)
class ArenaRange:
    offset: int
    nbytes: int          # committed, page-aligned
    payload_bytes: int   # bytes the tensors use


@dataclass(slots=True)
class WeightPlacement:
    shared: ArenaRange                                      # embeddings, final norm, untied LM head
    layers: list[ArenaRange] = field(default_factory=list)  # one per decoder layer

    @property
    def committed_bytes(self) -> int:
        return self.shared.nbytes + sum(r.nbytes for r in self.layers)


def _unique_params(module: nn.Module, exclude: set[int]) -> list[nn.Parameter]:
    params = []
    for p in module.parameters():
        if id(p) not in exclude:
            exclude.add(id(p))
            params.append(p)
    return params


def _aligned(nbytes: int, alignment: int = 64) -> int:
    return -(-nbytes // alignment) * alignment


def _range_bytes(params: list[nn.Parameter]) -> int:
    return sum(_aligned(p.numel() * p.element_size()) for p in params)


def weights_capacity_bytes(model: nn.Module, layers: nn.ModuleList, page_size: int) -> int:
    """Arena bytes needed: the shared range plus one page-rounded range per layer."""
    seen: set[int] = set()
    layer_params = [_unique_params(layer, seen) for layer in layers]
    shared_params = _unique_params(model, seen)
    round_up = lambda n: -(-max(n, 1) // page_size) * page_size  # noqa: E731
    return round_up(_range_bytes(shared_params)) + sum(round_up(_range_bytes(ps)) for ps in layer_params)


def _place(params: list[nn.Parameter], arena: PageArena, offset: int) -> ArenaRange:
    payload = _range_bytes(params)
    nbytes = -(-max(payload, 1) // arena.page_size) * arena.page_size
    arena.commit(offset, nbytes)
    cursor = offset
    for p in params:
        view = arena.view(cursor, tuple(p.shape), p.dtype)
        view.copy_(p.data)
        p.data = view
        cursor += _aligned(p.numel() * p.element_size())
    return ArenaRange(offset, nbytes, payload)


@torch.no_grad()
def place_weights(model: nn.Module, layers: nn.ModuleList, arena: PageArena) -> WeightPlacement:
    seen: set[int] = set()
    layer_params = [_unique_params(layer, seen) for layer in layers]
    shared_params = _unique_params(model, seen)  # what is left: embeddings, final norm, LM head if untied
    shared = _place(shared_params, arena, 0)
    placement = WeightPlacement(shared)
    offset = shared.nbytes
    for params in layer_params:
        r = _place(params, arena, offset)
        placement.layers.append(r)
        offset += r.nbytes
    return placement
