"""AutoAWQ's GEMM checkpoint layout (the format of pre-quantized AWQ checkpoints on the Hub: `quant_method: awq`,
`version: gemm` in config.json), read into our W4 layers without de-quantizing, and written from a weight.

Per quantized Linear [out, in] with `group_size` g, 4 bits, integer zero points:
- `qweight` int32 [in, out / 8]: eight 4-bit values per int32 along the output dimension, nibble i holding output
  column 8 * j + AWQ_ORDER[i] (AutoAWQ's interleaving for its GEMM kernel);
- `qzeros` int32 [in / g, out / 8]: the zero points, packed the same way;
- `scales` fp16 [in / g, out]; `bias` [out] where the Linear has one.
w[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]. Our W4 form is w = (q - 8) * scale + zero, so scale = s and
zero = (8 - z) * s: the same 4-bit integers, no re-quantization."""
from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8   # 4-bit values per int32


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols / 8] -> int32 [rows, cols] in [0, 15], undoing AutoAWQ's interleaving."""
    rows, packed_cols = packed.shape
    out = torch.empty(rows, packed_cols, PACK, dtype=torch.int32, device=packed.device)
    for nibble, column in enumerate(AWQ_ORDER):
        out[:, :, column] = (packed >> (4 * nibble)) & 15
    return out.reshape(rows, packed_cols * PACK)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [rows, cols] in [0, 15] -> int32 [rows, cols / 8], AutoAWQ's interleaving."""
    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"AWQ packs 8 values per int32: {cols} columns is not a multiple of 8")
    grouped = values.to(torch.int64).reshape(rows, cols // PACK, PACK)
    packed = torch.zeros(rows, cols // PACK, dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_ORDER):
        packed |= grouped[:, :, column] << (4 * nibble)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)   # the int32 bit pattern


def from_awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ GEMM tensors -> our W4 form (q int32 [out, in], scale [out, groups], zero [out, groups]) in fp32."""
    q = unpack_awq(qweight).t().contiguous()              # [out, in]
    z = unpack_awq(qzeros).t().float()                   # [out, groups]
    s = scales.t().float()                                # [out, groups]
    out_features, in_features = q.shape
    if in_features % group_size or s.shape != (out_features, in_features // group_size) or z.shape != s.shape:
        raise ValueError(f"AWQ tensors do not agree: qweight gives [{out_features}, {in_features}], scales "
                         f"{tuple(scales.shape)} and qzeros {tuple(qzeros.shape)} for group_size={group_size}")
    return q, s.contiguous(), ((8.0 - z) * s).contiguous()


def quantize_awq_gemm(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's quantizer (asymmetric, integer zero points) of a weight [out, in] whose AWQ scales are already
    folded in -> (qweight, qzeros, scales fp16) in its GEMM layout."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group_size, group_size)   # [out, groups, g]
    w_min, w_max = grouped.amin(-1), grouped.amax(-1)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).half().float()   # stored as fp16
    zeros = (-w_min / scales).round().clamp(0, 15)                    # [out, groups]
    q = (grouped / scales[..., None]).round().add(zeros[..., None]).clamp(0, 15).reshape(out_features, in_features)
    return pack_awq(q.t().contiguous()), pack_awq(zeros.t().contiguous()), scales.t().contiguous().half()
