"""The MLP of a Llama-family layer as one fused GEMM, one native pass and one GEMM, as vLLM's LlamaMLP runs it
(MergedColumnParallelLinear, SiluAndMul, RowParallelLinear): gate and up already share one product
(packed_linear.FusedProduct: oneDNN-packed, or stacked as in layers/stacked_linear.py); silu(gate) * up is taken
from it in a single pass (native/fused_elementwise.c) instead of eager torch's silu over the strided gate half, then
a product that reads the gate again with the up half. HF's MLP forward is `down_proj(act_fn(gate_proj(x)) *
up_proj(x))` with act_fn = SiLU; the switched module computes exactly that, rounding where torch rounds (bf16: the
activation, then the product).

On a GPU gate and up are two linears, or two members of one product over their stacked weight (a view of the arena,
layers/stacked_linear.py); SplitSwiGLUMLP takes silu(gate) * up of their outputs (two column ranges of that
product) in one Triton launch (native/triton_elementwise.py) instead of two kernels."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.packed_linear import FusedMemberLinear
from elastic_hf.layers.shardable_linear import ShardableLinear
from elastic_hf.native import triton_elementwise
from elastic_hf.native.fused_elementwise import native_elementwise_available, silu_and_mul

SILU_NAMES = ("silu", "swish")
# what HF's ACT2FN gives for them (transformers 5: its own SiLUActivation, F.silu inside), or torch's module
SILU_MODULES = ("SiLUActivation", "SiLU")


class SwiGLUMLP(nn.Module):
    """A switched HF MLP; `eager_class` is the class it was."""

    gate_proj: FusedMemberLinear
    up_proj: FusedMemberLinear
    down_proj: nn.Module
    eager_class: type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_proj.fused.product(x)           # [..., 2 * intermediate] = [gate | up]
        return self.down_proj(silu_and_mul(gate_up))        # [..., intermediate] -> [..., hidden]


class ShardedSwiGLUMLP(nn.Module):
    """A switched HF MLP over sharded linears (a TP / pipeline worker): gate and up share one product only while
    their shards lie back to back (shardable_linear.fuse_shards, redone at every reshape), else HF's formula."""

    gate_proj: ShardableLinear
    up_proj: ShardableLinear
    down_proj: nn.Module
    act_fn: nn.Module
    eager_class: type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.gate_proj.fused
        if fused is not None and fused.num_members == 2 and self.up_proj.fused is fused:
            return self.down_proj(silu_and_mul(fused.product(x)))   # [..., 2 * shard] -> [..., hidden]
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SplitSwiGLUMLP(nn.Module):
    """A switched HF MLP on CUDA with separate gate and up linears; `eager_class` is the class it was."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    act_fn: nn.Module
    eager_class: type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)          # [..., intermediate] each
        if gate.device.type != "cuda" or gate.dtype != up.dtype or gate.shape != up.shape:
            return self.down_proj(self.act_fn(gate) * up)      # HF's formula, on the projections already made
        return self.down_proj(triton_elementwise.silu_and_mul(gate, up))   # -> [..., hidden]


def _silu_between(mlp: nn.Module, hidden_act: str | None) -> bool:
    return hidden_act in SILU_NAMES and type(getattr(mlp, "act_fn", None)).__name__ in SILU_MODULES


def split_swiglu_fusable(mlp: nn.Module, hidden_act: str | None, device: torch.device) -> bool:
    """An HF MLP with gate_proj, up_proj and down_proj and SiLU between, on a device with the Triton kernel."""
    return (all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) and device.type == "cuda"
            and _silu_between(mlp, hidden_act)
            and triton_elementwise.triton_elementwise_available(torch.float32, device))


def swiglu_fusable(mlp: nn.Module, hidden_act: str | None) -> bool:
    """An HF MLP whose gate and up are the two members, in that order, of one fused product, with SiLU between."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (isinstance(gate, FusedMemberLinear) and isinstance(up, FusedMemberLinear)):
        return False
    return (_silu_between(mlp, hidden_act) and gate.fused is up.fused and gate.fused.num_members == 2
            and gate.column_start == 0
            and up.column_start == gate.out_features == up.out_features
            and native_elementwise_available(gate.fused.packed_weight.dtype, torch.device("cpu")))


def sharded_swiglu_fusable(mlp: nn.Module, hidden_act: str | None) -> bool:
    """An HF MLP whose gate and up are packed CPU shards of one dtype (layers/shardable_linear.py), SiLU between."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    return (isinstance(gate, ShardableLinear) and isinstance(up, ShardableLinear) and gate.packed and up.packed
            and gate.dtype == up.dtype and hasattr(mlp, "down_proj") and _silu_between(mlp, hidden_act)
            and native_elementwise_available(gate.dtype, torch.device("cpu")))


def use_swiglu_mlps(mlps: list[nn.Module], hidden_act: str | None, device: torch.device | None = None) -> int:
    """Switch every fusable MLP in place (same module, same children): on the CPU those on one fused gate/up
    product, on CUDA those with gate and up linears. Returns how many."""
    device = torch.device(device or "cpu")
    switched = 0
    for mlp in mlps:
        if device.type == "cpu" and swiglu_fusable(mlp, hidden_act):
            cls = SwiGLUMLP
        elif device.type == "cpu" and sharded_swiglu_fusable(mlp, hidden_act):
            cls = ShardedSwiGLUMLP
        elif split_swiglu_fusable(mlp, hidden_act, device):
            cls = SplitSwiGLUMLP
        else:
            continue
        mlp.eager_class = type(mlp)
        mlp.__class__ = cls
        switched += 1
    return switched
