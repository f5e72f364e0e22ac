"""CPU linears on oneDNN *prepacked* weights: the weight reordered once, at load, into the blocked layout oneDNN's
inner-product kernel reads (`torch.ops.mkldnn._reorder_linear_weight`), instead of a plain [out, in] matrix that
the kernel reorders or reads with strided loads on every call. This is what vLLM's CPU build does
(`dispatch_cpu_unquantized_gemm` prepacks and drops the plain weight).

Measured on this project's 2-core AMD EPYC (AVX-512 + AVX512-BF16), 2 threads, packed with a batch hint of 32
(`python benchmarks/cpu_gemm.py`), time per call in us: bf16 plain `F.linear` / packed, fp32 unpacked oneDNN (our
fp32 path before packing) / packed:

    weight [out, in]     bf16 M=1       M=4           M=32          fp32 M=4       M=32
    1536 x 576           104 / 38       80 / 45       188 / 148     109 / 59       325 / 276
    576 x 1536           58 / 33        79 / 39       195 / 180     107 / 60       349 / 300
    49152 x 576 (head)   4497 / 2238    4653 / 1970   8182 / 5578   6670 / 3030    14039 / 9586

bf16 results are bit-identical to `F.linear` for every M tried (1 to 512); fp32 ones differ in the last bits
(~1e-6 relative), as the unpacked oneDNN path (layers/cpu_gemm.py) already does. The packed tensor is an opaque
MKLDNN tensor with exactly the plain weight's byte count; torch cannot build one over an existing buffer, so it
lives in the CPU allocator, outside the weights arena. PlacedWeights.pack_linears therefore decommits the arena
pages of every packed weight nobody else reads and charges the packed bytes to the ledger: memory stays the same
and the ledger stays true. A weight shared with another module (a tied LM head is the embedding table) keeps its
plain copy, and its packed copy is extra, counted memory.

Packing needs the plain weight to stay untouched for good, so it is for deployments whose weights never change
after load: one worker (no TP shards, no pipeline stages, no reshapes) and no precision morphing
(EngineConfig.packed_weights)."""
from __future__ import annotations

import torch
from torch import nn

from elastic_hf.layers.cpu_gemm import MIN_ONEDNN_NUMEL, OneDnnLinear, default_backend, onednn_available

# oneDNN picks the blocked layout for this many rows; measured equally good from decode (M=1) to prefill (M=512).
PACK_BATCH_HINT = 32


def packing_available() -> bool:
    """oneDNN with its weight reorder, and the CPU GEMM backend not forced to ATen (ELASTIC_HF_CPU_GEMM=aten)."""
    return (onednn_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and default_backend() == "onednn")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads `packed_weight` (oneDNN layout). Its `weight` Parameter may have been
    replaced by a meta tensor of the same shape once its pages went back (see PlacedWeights.pack_linears)."""

    packed_weight: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., in_features] -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def takes_packing(module: nn.Module) -> bool:
    """A plain (or oneDNN) CPU linear in bf16, or in fp32 when large enough for oneDNN to win at all (the rule of
    layers/cpu_gemm.py); quantized, sharded, fp16 and GPU linears keep their own kernels."""
    if type(module) not in (nn.Linear, OneDnnLinear) or module.weight.device.type != "cpu":
        return False
    dtype = module.weight.dtype
    return dtype == torch.bfloat16 or (dtype == torch.float32 and module.weight.numel() >= MIN_ONEDNN_NUMEL)


@torch.no_grad()
def pack_linear(module: nn.Linear) -> int:
    """Give `module` its packed weight and switch it to PackedLinear, in place (same module object). Returns the
    packed tensor's bytes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH_HINT)
    module.packed_weight = packed
    module.__class__ = PackedLinear
    return int(torch.ops.mkldnn._nbytes(packed))
