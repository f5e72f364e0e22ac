"""Weight-only quantization schemes and their round-to-nearest math.

A scheme is what a quantized layer variant is: bit width, group size (W4 only) and how the scales were chosen
(plain round-to-nearest or AWQ). The functions here define the numeric format that the aten int-pack kernels
consume, so every other module (the linear layers, the AWQ search, the profiler) quantizes through them:

- W8: symmetric per output channel, w ~ q * scale with q in [-127, 127] (int8), scale = max|w_row| / 127.
- W4: asymmetric per (output channel, group of `group_size` input channels), q in [0, 15],
  w ~ (q - 8) * scale + zero, scale = (max - min) / 15, zero = min + 8 * scale. This is the "tinygemm"
  convention of `_weight_int4pack_mm*`: the kernels subtract 8 from the unsigned nibble themselves.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

QUANT_SCHEMES = ("w8", "w4")
QUANT_METHODS = ("rtn", "awq")
W4_GROUP_SIZES = (32, 64, 128)
# 64 divides the input dims of every linear of the default model (576, 1536); 128 does not divide 576.
DEFAULT_W4_GROUP_SIZE = 64

# A group whose weights are all equal has max == min; a tiny floor keeps the scale finite without changing
# any group that has a real range (fp32 weights of trained models are far above this).
_MIN_SCALE = 1e-8


@dataclass(frozen=True, slots=True)
class QuantScheme:
    quant: str = "w4"                  # "w8" | "w4"
    group_size: int | None = DEFAULT_W4_GROUP_SIZE   # W4 only; None for W8 (per output channel)
    method: str = "rtn"                # "rtn" | "awq"

    def __post_init__(self):
        if self.quant not in QUANT_SCHEMES:
            raise ValueError(f"quant={self.quant!r} is not a known quantization scheme; allowed: {', '.join(QUANT_SCHEMES)}")
        if self.method not in QUANT_METHODS:
            raise ValueError(f"method={self.method!r} is not a known quantization method; allowed: {', '.join(QUANT_METHODS)}")
        if self.quant == "w4":
            if self.group_size not in W4_GROUP_SIZES:
                raise ValueError(f"group_size={self.group_size!r} is not supported for w4; allowed: "
                                 f"{', '.join(map(str, W4_GROUP_SIZES))}")
        elif self.group_size is not None:
            raise ValueError(f"group_size={self.group_size} only applies to w4; w8 is per output channel (use None)")

    @classmethod
    def create(cls, quant: str = "w4", group_size: int | None = None, method: str = "rtn") -> "QuantScheme":
        """Like the constructor, but fills in the W4 default group size and ignores group_size=None for W8."""
        if quant == "w4" and group_size is None:
            group_size = DEFAULT_W4_GROUP_SIZE
        if quant == "w8":
            group_size = None
        return cls(quant=quant, group_size=group_size, method=method)

    @property
    def bits(self) -> int:
        return 8 if self.quant == "w8" else 4

    @property
    def name(self) -> str:
        """A short label such as "w4-g128-awq" (file names, plots, JSON)."""
        group = f"-g{self.group_size}" if self.group_size else ""
        return f"{self.quant}{group}-{self.method}"

    def check_in_features(self, in_features: int, what: str = "layer") -> None:
        if self.quant == "w4" and in_features % self.group_size:
            raise ValueError(f"group_size={self.group_size} does not divide the input dimension {in_features} of "
                             f"{what}; allowed group sizes for it: "
                             f"{', '.join(str(g) for g in W4_GROUP_SIZES if in_features % g == 0) or 'none'}")

    def to_dict(self) -> dict:
        return {"quant": self.quant, "group_size": self.group_size, "method": self.method, "bits": self.bits}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "QuantScheme":
        return cls(quant=data["quant"], group_size=data.get("group_size"), method=data.get("method", "rtn"))


def quantize_w8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8. weight [out, in] -> (q int8 [out, in], scales fp32 [out])."""
    weight = weight.float()
    scales = (weight.abs().amax(dim=1) / 127.0).clamp(min=_MIN_SCALE)  # [out]
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # [out, in]
    return q, scales


def dequantize_w8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]  # [out, in]


def _w4_grid(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q as float in [0, 15] [out, groups, g], scales [out, groups], zeros [out, groups])."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group_size={group_size} does not divide the input dimension {in_features}")
    grouped = weight.float().reshape(out_features, in_features // group_size, group_size)  # [out, groups, g]
    w_min, w_max = torch.aminmax(grouped, dim=-1)
    scales = ((w_max - w_min) / 15.0).clamp_(min=_MIN_SCALE)  # [out, groups]
    q = (grouped - w_min[..., None]).div_(scales[..., None]).round_().clamp_(0, 15)
    zeros = w_min + 8.0 * scales
    return q, scales, zeros


def quantize_w4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric group-wise uint4. weight [out, in] -> (q int32 in [0, 15] [out, in], scales [out, in/g],
    zeros [out, in/g]) with w ~ (q - 8) * scale + zero."""
    q, scales, zeros = _w4_grid(weight, group_size)
    return q.to(torch.int32).reshape(weight.shape), scales, zeros


def dequantize_w4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    out_features, in_features = q.shape
    grouped = q.float().reshape(out_features, in_features // group_size, group_size)
    return ((grouped - 8.0) * scales[..., None] + zeros[..., None]).reshape(out_features, in_features)


def fake_quantize(weight: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """The weight the kernels effectively multiply with (fp32). Used by calibration (AWQ search), never on the
    serving path."""
    if scheme.quant == "w8":
        return dequantize_w8(*quantize_w8(weight))
    # Same numbers as dequantize_w4(*quantize_w4(w)), in place: the AWQ search calls this ~100 times per layer.
    q, scales, zeros = _w4_grid(weight, scheme.group_size)
    return q.sub_(8.0).mul_(scales[..., None]).add_(zeros[..., None]).reshape(weight.shape)
