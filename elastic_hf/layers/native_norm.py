"""RMSNorm modules on the native fused kernel (native/fused_elementwise.c): one pass over the rows instead of eager
torch's 5-7 ops (to, pow, mean as sum + div, add, rsqrt, mul, mul). The module is switched in place, like the
linears of packed_linear.py, and keeps its `weight` and `variance_epsilon`, so swaps and reshapes that write the
weight see no difference. The formula is HF's LlamaRMSNorm (Qwen2 and Mistral use the same); results equal the
eager ones up to the order of the sum of squares (fp32: the last bit; bf16: identical after rounding, almost
always). On a GPU the same formula runs as one Triton kernel (native/triton_elementwise.py). A norm whose input or
weight no kernel takes (another dtype, a device without its kernel) runs HF's own forward."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.native import triton_elementwise
from elastic_hf.native.fused_elementwise import native_elementwise_available, rms_norm


def _norm_kernel(dtype: torch.dtype, device: torch.device):
    """The fused RMSNorm for this dtype on this device (C on the CPU, Triton on CUDA), or None."""
    if device.type == "cpu":
        return rms_norm if native_elementwise_available(dtype, device) else None
    if device.type == "cuda" and triton_elementwise.triton_elementwise_available(dtype, device):
        return triton_elementwise.rms_norm
    return None


class NativeRMSNorm(nn.Module):
    """A switched HF RMSNorm; `eager_class` is the class it was, whose forward handles what the kernel does not."""

    weight: nn.Parameter
    variance_epsilon: float
    eager_class: type

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden_states.dtype == weight.dtype and hidden_states.device == weight.device:
            kernel = _norm_kernel(weight.dtype, weight.device)
            if kernel is not None:
                return kernel(hidden_states, weight, self.variance_epsilon)   # [..., hidden] -> [..., hidden]
        return self.eager_class.forward(self, hidden_states)


def use_native_norms(modules: list[nn.Module], norm_class_name: str) -> int:
    """Switch every module of class `norm_class_name` (an HF RMSNorm with Llama's formula) to NativeRMSNorm when
    the kernel takes its weight. Returns how many were switched."""
    switched = 0
    for module in modules:
        if type(module).__name__ != norm_class_name:
            continue
        weight = module.weight
        if weight.dim() != 1 or _norm_kernel(weight.dtype, weight.device) is None:
            continue
        module.eager_class = type(module)
        module.__class__ = NativeRMSNorm
        switched += 1
    return switched
