"""QuantLinear: the weight-only quantized replacements of nn.Linear (W8Linear, W4Linear) and their factory."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.layers.w4_linear import W4Linear
from elastic_hf.layers.w8_linear import W8Linear

QuantLinear = W8Linear | W4Linear


def is_quant_linear(module: nn.Module) -> bool:
    return isinstance(module, (W8Linear, W4Linear))


def quantize_linear(linear: nn.Linear, scheme: QuantScheme, name: str = "linear") -> QuantLinear:
    """Round-to-nearest quantized copy of `linear` (AWQ scales, if any, are already folded into its weight)."""
    scheme.check_in_features(linear.in_features, name)
    if scheme.quant == "w8":
        return W8Linear.from_linear(linear)
    return W4Linear.from_linear(linear, scheme.group_size)


def empty_quant_linear(in_features: int, out_features: int, has_bias: bool, scheme: QuantScheme,
                       device: torch.device | str | None = None, name: str = "linear") -> QuantLinear:
    """A QuantLinear with the right shapes to load a state dict into."""
    scheme.check_in_features(in_features, name)
    if scheme.quant == "w8":
        return W8Linear(in_features, out_features, has_bias, device=device)
    return W4Linear(in_features, out_features, scheme.group_size, has_bias, device=device)


def reference_linear(layer: QuantLinear) -> nn.Linear:
    """An fp32 nn.Linear holding exactly the weights the kernel multiplies with.

    For offline tools only (calibration, LIS profiling, perplexity sweeps): on CPUs without AVX2/AVX-512 the aten
    int-pack kernels run a scalar fallback that is 10-250x slower than an fp32 GEMM at M >= 16 (see
    benchmarks/quant_kernels.py), while their result equals this dense product to ~1e-6 relative error."""
    weight = layer.dequantized_weight()  # [out, in]
    dense = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                      device=weight.device, dtype=torch.float32)
    dense.weight.data.copy_(weight)
    if layer.bias is not None:
        dense.bias.data.copy_(layer.bias.float())
    return dense.requires_grad_(False)
