"""W4 weight-only linear layer: asymmetric group-wise uint4 on `aten._weight_int4pack_mm[_for_cpu]`.

The kernels want the weight in an opaque, device- and ISA-specific tiled layout (`_convert_weight_to_int4pack*`)
and aten offers no inverse. A layer keeps only that packed form in memory (no second copy) and its state dict
holds a portable form instead: `qweight` uint8 [out, in/2], column 2j in the low nibble and 2j+1 in the high
nibble, plus `scales_and_zeros` [in/group, out, 2] (scale, zero) in fp32. To turn the packed form back into the
portable one we learn, once per (shape, device), where the packer puts every nibble: packing is a pure nibble
permutation, so packing a few probe matrices whose nibbles spell out their own position reveals it.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from elastic_hf.layers.kernel_dtype import INT_PACK_KERNEL_DTYPE
from elastic_hf.layers.quant_scheme import QuantScheme, dequantize_w4, quantize_w4
from elastic_hf.native.quant_gemm import quant_gemm, quant_gemm_supports, w4_from_blocked, w4_to_blocked

_CUDA_INNER_K_TILES = (8, 4, 2)


def _inner_k_tiles(in_features: int) -> int:
    # The CUDA kernel tiles K by inner_k_tiles * 16; take the largest tiling that divides K.
    for tiles in _CUDA_INNER_K_TILES:
        if in_features % (tiles * 16) == 0:
            return tiles
    raise ValueError(f"in_features={in_features} must be a multiple of 32 for the int4 CUDA kernel")


def pack_int4(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """q int32 in [0, 15] [out, in] -> the kernel layout for `device`."""
    if device.type == "cuda":
        q = q.to(device)
        nibble_pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # [out, in/2], CUDA wants even in high
        return torch.ops.aten._convert_weight_to_int4pack(nibble_pairs, _inner_k_tiles(q.shape[1]))
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(device).contiguous(), 1)


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    raw = packed.contiguous().view(torch.uint8).reshape(-1).to(torch.int64)
    return torch.stack([raw & 15, raw >> 4], dim=-1).reshape(-1)  # [2 * num_bytes]


@functools.lru_cache(maxsize=32)
def _nibble_sources(out_features: int, in_features: int, device_str: str) -> torch.Tensor:
    """For every nibble of the packed tensor, the flat index (row * in + col) of the weight it holds."""
    device = torch.device(device_str)
    positions = torch.arange(out_features * in_features, device=device)
    sources = torch.zeros_like(positions)
    for digit in range((int(positions.numel() - 1).bit_length() + 3) // 4):
        probe = ((positions >> (4 * digit)) & 15).to(torch.int32).reshape(out_features, in_features)
        sources |= _nibbles(pack_int4(probe, device)) << (4 * digit)
    return sources


def unpack_int4(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """Inverse of `pack_int4`: the kernel layout -> q int32 [out, in]."""
    sources = _nibble_sources(out_features, in_features, str(packed.device))
    flat = torch.empty(out_features * in_features, dtype=torch.int64, device=packed.device)
    flat[sources] = _nibbles(packed)
    return flat.reshape(out_features, in_features).to(torch.int32)


def to_portable_qweight(q: torch.Tensor) -> torch.Tensor:
    return (q[:, ::2] | (q[:, 1::2] << 4)).to(torch.uint8)  # [out, in/2]


def from_portable_qweight(qweight: torch.Tensor) -> torch.Tensor:
    low = (qweight & 15).to(torch.int32)
    high = (qweight >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(qweight.shape[0], qweight.shape[1] * 2)  # [out, in]


class W4Linear(nn.Module):
    """y = x @ W4^T + bias with W4 group-wise uint4 (no fp weight kept).

    On an AVX-512 or AVX2 + FMA CPU (shapes in whole 64-output blocks, K and the group in 16-wide tiles)
    `weight_packed` holds our blocked nibble layout [out/64, in/16, 16, 32] and native/quant_gemm.c multiplies in
    fp32 (vs the dequantized reference: relative error ~1e-6 for fp32 activations; bf16 ones get one rounding of the
    output). Elsewhere it holds aten's int4-pack layout and aten's kernel runs, with activations and scales cast to
    bf16 at the boundary (see kernel_dtype.py: on CPU the bf16 path is the vectorized one, on CUDA the kernel needs
    it) and the output cast back; vs the reference: relative error ~4e-3 from bf16 rounding."""

    def __init__(self, in_features: int, out_features: int, group_size: int, has_bias: bool, device=None):
        super().__init__()
        QuantScheme(quant="w4", group_size=group_size).check_in_features(in_features)
        device = torch.device(device or "cpu")
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        self.scheme = QuantScheme(quant="w4", group_size=group_size)
        zeros_q = torch.full((out_features, in_features), 8, dtype=torch.int32)
        self.blocked = quant_gemm_supports(out_features, in_features, device, group_size)
        # Kernel-layout weight; not in the state dict (the portable `qweight` is, see module docstring).
        self.register_buffer("weight_packed", self._pack(zeros_q, device), persistent=False)
        sz_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.register_buffer("scales_and_zeros", torch.zeros(in_features // group_size, out_features, 2,
                                                             dtype=sz_dtype, device=device))
        self.register_buffer("bias", torch.zeros(out_features, device=device) if has_bias else None)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, group_size: int, bias: torch.Tensor | None = None) -> "W4Linear":
        out_features, in_features = weight.shape
        layer = cls(in_features, out_features, group_size, bias is not None, device=weight.device)
        q, scales, zeros = quantize_w4(weight, group_size)  # [out, in], [out, groups], [out, groups]
        layer._set_quantized(q, scales, zeros)
        if bias is not None:
            layer.bias.copy_(bias.float())
        return layer

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                       bias: torch.Tensor | None = None, device=None) -> "W4Linear":
        """A layer holding given 4-bit values (q int32 [out, in] in [0, 15], scales and zeros [out, in/g]): a
        pre-quantized checkpoint's, taken as they are (layers/awq_format.py)."""
        out_features, in_features = q.shape
        layer = cls(in_features, out_features, group_size, bias is not None, device=device or q.device)
        layer._set_quantized(q, scales, zeros)
        if bias is not None:
            layer.bias.copy_(bias.float())
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int) -> "W4Linear":
        return cls.from_weight(linear.weight.detach(), group_size,
                               None if linear.bias is None else linear.bias.detach())

    def _pack(self, q: torch.Tensor, device: torch.device) -> torch.Tensor:
        """q int32 [out, in] in [0, 15] -> this layer's kernel layout."""
        return w4_to_blocked(q).to(device) if self.blocked else pack_int4(q, device)

    def _unpack(self) -> torch.Tensor:
        """The kernel layout -> q int32 [out, in]."""
        if self.blocked:
            return w4_from_blocked(self.weight_packed)
        return unpack_int4(self.weight_packed, self.out_features, self.in_features)

    def _set_quantized(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> None:
        device = self.scales_and_zeros.device
        self.weight_packed = self._pack(q, device)
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # [groups, out, 2]
        self.scales_and_zeros.copy_(sz.to(self.scales_and_zeros.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blocked:
            kernel_x = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
            out = quant_gemm(kernel_x, self.weight_packed, self.bias, scales_and_zeros=self.scales_and_zeros,
                             group_size=self.group_size)             # [..., out]
            return out.to(x.dtype)
        lead_shape = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features).to(INT_PACK_KERNEL_DTYPE)  # [num_tokens, in]
        scales_and_zeros = self.scales_and_zeros.to(INT_PACK_KERNEL_DTYPE)
        if x.device.type == "cuda":
            out = torch.ops.aten._weight_int4pack_mm(x2d, self.weight_packed, self.group_size, scales_and_zeros)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d.contiguous(), self.weight_packed, self.group_size,
                                                             scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out.to(x.dtype).reshape(*lead_shape, self.out_features)  # [..., out]

    def quantized_values(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q int32 [out, in], scales [out, groups], zeros [out, groups]) in fp32."""
        q = self._unpack()
        sz = self.scales_and_zeros.float().transpose(0, 1)  # [out, groups, 2]
        return q, sz[..., 0].contiguous(), sz[..., 1].contiguous()

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_w4(*self.quantized_values(), self.group_size)  # [out, in] fp32

    @property
    def nbytes(self) -> int:
        tensors = [self.weight_packed, self.scales_and_zeros] + ([self.bias] if self.bias is not None else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        q = self._unpack()
        destination[prefix + "qweight"] = to_portable_qweight(q).cpu() if not keep_vars else to_portable_qweight(q)
        destination[prefix + "scales_and_zeros"] = self.scales_and_zeros.float()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "qweight"
        sz_key = prefix + "scales_and_zeros"
        if sz_key in state_dict:
            state_dict[sz_key] = state_dict[sz_key].to(self.scales_and_zeros.dtype)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        if key not in state_dict:
            missing_keys.append(key)
            return
        qweight = state_dict[key]
        expected = (self.out_features, self.in_features // 2)
        if tuple(qweight.shape) != expected or qweight.dtype != torch.uint8:
            error_msgs.append(f"{key}: expected uint8 {expected}, got {qweight.dtype} {tuple(qweight.shape)}")
            return
        self.weight_packed = self._pack(from_portable_qweight(qweight), self.scales_and_zeros.device)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w4 group_size={self.group_size}")
