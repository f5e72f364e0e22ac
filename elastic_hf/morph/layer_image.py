"""A decoder-layer variant as one flat byte image plus a manifest of the tensors inside it.

A swap is then one copy of the whole image into the layer's arena range (one memcpy on CPU, one
cudaMemcpyAsync on CUDA, as MorphServe Appendix C), and the variant's module reads its tensors as zero-copy views
of that range: nothing is re-packed or re-allocated when a layer changes precision."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from elastic_hf.memory.arena import PageArena
from elastic_hf.units import round_up

_ALIGN = 64  # every tensor starts on a cache line (and on any dtype's itemsize)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str                  # dotted name inside the layer, e.g. "mlp.down_proj.weight_packed"
    is_param: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int                # bytes from the start of the image
    nbytes: int


@dataclass(slots=True)
class LayerImage:
    specs: list[TensorSpec]
    data: torch.Tensor         # uint8 [nbytes] on the host (pinned when the layers live on a GPU)

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _aligned(nbytes: int) -> int:
    return round_up(nbytes, _ALIGN)


def tensor_specs(module: nn.Module) -> list[TensorSpec]:
    """Every parameter and (non-None) buffer of `module`, packed back to back at 64-byte boundaries."""
    specs: list[TensorSpec] = []
    seen: set[int] = set()
    offset = 0
    named = [(n, t, True) for n, t in module.named_parameters()] + [(n, t, False) for n, t in module.named_buffers()]
    for name, tensor, is_param in named:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        nbytes = tensor.numel() * tensor.element_size()
        specs.append(TensorSpec(name, is_param, tuple(tensor.shape), tensor.dtype, offset, nbytes))
        offset += _aligned(nbytes)
    return specs


def image_nbytes(specs: list[TensorSpec]) -> int:
    return max((s.offset + s.nbytes for s in specs), default=0)


def _host_bytes(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)  # zeros: alignment gaps stay deterministic


def _tensor(module: nn.Module, spec: TensorSpec) -> torch.Tensor:
    owner_name, _, leaf = spec.name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    return (owner._parameters if spec.is_param else owner._buffers)[leaf]


@torch.no_grad()
def build_image(module: nn.Module, pin: bool) -> LayerImage:
    """Copy every tensor of `module` into one host byte image (the module is left untouched)."""
    specs = tensor_specs(module)
    data = _host_bytes(image_nbytes(specs), pin)
    for spec in specs:
        src = _tensor(module, spec).detach().contiguous().reshape(-1).view(torch.uint8)  # [nbytes]
        data[spec.offset:spec.offset + spec.nbytes].copy_(src)
    return LayerImage(specs, data)


@torch.no_grad()
def image_of_range(arena: PageArena, offset: int, nbytes: int, pin: bool) -> torch.Tensor:
    """The bytes of a committed arena range, copied to the host: the full-precision image of a placed layer."""
    data = _host_bytes(nbytes, pin)
    data.copy_(arena.view(offset, (nbytes,), torch.uint8))
    return data


@torch.no_grad()
def bind_to_arena(module: nn.Module, specs: list[TensorSpec], arena: PageArena, offset: int) -> None:
    """Make every tensor of `module` a zero-copy view of arena[offset + spec.offset]. The range need not be
    committed yet: the module must only run after a swap committed it and copied the image in."""
    for spec in specs:
        view = arena.view(offset + spec.offset, spec.shape, spec.dtype, require_committed=False)
        owner_name, _, leaf = spec.name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        if spec.is_param:
            owner._parameters[leaf].data = view
        else:
            owner._buffers[leaf] = view
