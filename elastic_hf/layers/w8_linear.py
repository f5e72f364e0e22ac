"""W8 weight-only linear layer: symmetric per-output-channel int8 on `aten._weight_int8pack_mm`."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.kernel_dtype import INT_PACK_KERNEL_DTYPE
from elastic_hf.layers.quant_scheme import QuantScheme, dequantize_w8, quantize_w8


class W8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias with q int8 [out, in], computed by the int8-pack kernel (no fp weight).

    On CPU the kernel takes fp32, bf16 or fp16 activations directly, so fp32 models stay fp32 (kernel vs
    dequantized reference: relative error ~1e-6). On CUDA activations are cast to bf16 at the boundary and the
    output back to the input dtype (relative error ~3e-3 from bf16 rounding)."""

    scheme = QuantScheme(quant="w8", group_size=None)

    def __init__(self, in_features: int, out_features: int, has_bias: bool, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if has_bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "W8Linear":
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias is not None, device=weight.device)
        q, scales = quantize_w8(weight)
        layer.qweight.copy_(q)
        layer.scales.copy_(scales)
        if bias is not None:
            layer.bias.copy_(bias.float())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "W8Linear":
        return cls.from_weight(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead_shape = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(INT_PACK_KERNEL_DTYPE)  # [num_tokens, in]
        scales = self.scales.to(INT_PACK_KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, scales)  # [num_tokens, out]
        if self.bias is not None:
            out = out + self.bias.to(INT_PACK_KERNEL_DTYPE)
        return out.to(x.dtype).reshape(*lead_shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_w8(self.qweight, self.scales)  # [out, in] fp32

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, w8"
