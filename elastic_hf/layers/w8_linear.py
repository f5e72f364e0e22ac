"""W8 weight-only linear layer: symmetric per-output-channel int8, on the CPU on our own kernel (native/quant_gemm.c)
over a blocked layout, elsewhere on `aten._weight_int8pack_mm` over the plain [out, in] one."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.kernel_dtype import INT_PACK_KERNEL_DTYPE
from elastic_hf.layers.quant_scheme import QuantScheme, dequantize_w8, quantize_w8
from elastic_hf.native.quant_gemm import quant_gemm, quant_gemm_supports, w8_from_blocked, w8_to_blocked


class W8Linear(nn.Module):
    """y = x @ (q * scale)^T + bias with q int8 [out, in] (no fp weight kept).

    On an AVX-512 or AVX2 + FMA CPU (shapes in whole 64-output blocks, K a multiple of 16) `qweight` is held in the
    kernel's blocked layout [out/64, in/16, 16, 64] and multiplied by native/quant_gemm.c in fp32: fp32 models stay
    fp32 (vs the dequantized reference: relative error ~1e-6), bf16 ones get one rounding of the output; at decode's
    few rows it reads a quarter of an fp32 weight's bytes, at a prefill's hundreds of rows it runs near the fp32
    product's rate (aten's int8-pack kernel: 0.4x at 256 rows). The state dict always holds the plain [out, in]
    form, so cached variants and checkpoints do not depend on the CPU. Elsewhere (CUDA, other CPUs or shapes) the
    aten kernel runs on the plain layout with activations cast to bf16 at the boundary (relative error ~3e-3 from
    bf16 rounding)."""

    scheme = QuantScheme(quant="w8", group_size=None)

    def __init__(self, in_features: int, out_features: int, has_bias: bool, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.blocked = quant_gemm_supports(out_features, in_features, device)
        shape = (out_features // 64, in_features // 16, 16, 64) if self.blocked else (out_features, in_features)
        self.register_buffer("qweight", torch.zeros(shape, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if has_bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "W8Linear":
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, bias is not None, device=weight.device)
        q, scales = quantize_w8(weight)
        layer._set_q(q)
        layer.scales.copy_(scales)
        if bias is not None:
            layer.bias.copy_(bias.float())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "W8Linear":
        return cls.from_weight(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())

    def _set_q(self, q: torch.Tensor) -> None:
        """q int8 [out, in] into `qweight`, in this layer's layout."""
        self.qweight.copy_(w8_to_blocked(q) if self.blocked else q)

    def plain_qweight(self) -> torch.Tensor:
        """q int8 [out, in], whatever the layout held."""
        return w8_from_blocked(self.qweight) if self.blocked else self.qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            if x.dtype in (torch.float32, torch.bfloat16):
                return quant_gemm(x, self.qweight, self.bias, scales=self.scales)  # [..., out]
            return quant_gemm(x.float(), self.qweight, self.bias, scales=self.scales).to(x.dtype)
        lead_shape = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(INT_PACK_KERNEL_DTYPE)  # [num_tokens, in]
        scales = self.scales.to(INT_PACK_KERNEL_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(x2d, self.qweight, scales)  # [num_tokens, out]
        if self.bias is not None:
            out = out + self.bias.to(INT_PACK_KERNEL_DTYPE)
        return out.to(x.dtype).reshape(*lead_shape, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_w8(self.plain_qweight(), self.scales)  # [out, in] fp32

    @property
    def nbytes(self) -> int:
        tensors = [self.qweight, self.scales] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.blocked:   # the portable [out, in] form
            q = self.plain_qweight()
            destination[prefix + "qweight"] = q if keep_vars else q.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "qweight"
        qweight = state_dict.get(key)
        if self.blocked and qweight is not None:
            expected = (self.out_features, self.in_features)
            if tuple(qweight.shape) != expected or qweight.dtype != torch.int8:
                error_msgs.append(f"{key}: expected int8 {expected}, got {qweight.dtype} {tuple(qweight.shape)}")
                return
            state_dict = {**state_dict, key: w8_to_blocked(qweight.to(self.qweight.device))}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, w8"
