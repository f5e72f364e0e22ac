"""fp32 linears on CPU through oneDNN instead of ATen's BLAS call.

PyTorch's CPU wheels route an fp32 `F.linear` to MKL's sgemm. On AMD CPUs MKL does not take its AVX-512 paths,
while oneDNN (bundled in the same wheel, reachable as `torch.ops.mkldnn._linear_pointwise`) JIT-compiles for the
ISA the CPU reports. Measured on this project's 2-core AMD EPYC (AVX-512), 2 threads, the default model's shapes
(`python benchmarks/cpu_gemm.py`):

    weight [out, in]   M=1: aten / oneDNN     M=32              M=128
    576 x 576          28 / 35 us             185 / 144 us      464 / 432 us
    192 x 576          9 / 19 us              65 / 72 us        156 / 156 us
    1536 x 576         70 / 43 us             458 / 394 us      1242 / 1065 us
    576 x 1536         59 / 62 us             458 / 348 us      1225 / 1120 us
    49152 x 576 (head) 10.1 / 4.7 ms          22.9 / 12.6 ms    61.7 / 38.8 ms

oneDNN wins on every weight of at least 576 x 576 and loses on the small K/V projections (its per-call overhead
is ~10 us), so only weights of at least MIN_ONEDNN_NUMEL elements switch. The rule is a fixed size threshold,
not a timing-based choice: which backend computes a linear changes the last bits of its result (relative
difference ~1e-6), and outputs must not depend on a benchmark's luck.

The weight stays the same Parameter (a view into the weights arena); oneDNN reads it in place, so morphing and
memory accounting see nothing different."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

MIN_ONEDNN_NUMEL = 576 * 576
BACKENDS = ("onednn", "aten")
ENV_VAR = "ELASTIC_HF_CPU_GEMM"


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # [..., in_features] -> [..., out_features]; oneDNN caches one primitive per input shape.
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _takes_onednn(weight: torch.Tensor) -> bool:
    """The size rule above, for a weight the caller already decided to run through oneDNN if it can."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.numel() >= MIN_ONEDNN_NUMEL


class OneDnnLinear(nn.Linear):
    """An nn.Linear whose forward runs oneDNN's fp32 inner-product primitive (any leading dims)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _onednn_linear(x, self.weight, self.bias)


def fp32_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through oneDNN when the same rule as use_onednn_linears picks it (for linears that are not
    nn.Linear modules, e.g. a tensor-parallel shard). x: [..., in], weight: [out, in] contiguous -> [..., out]."""
    if (x.dtype == torch.float32 and _takes_onednn(weight) and default_backend() == "onednn"
            and onednn_available()):
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def default_backend() -> str:
    backend = os.environ.get(ENV_VAR, "onednn")
    if backend not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={backend!r} is not one of {', '.join(BACKENDS)}")
    return backend


def use_onednn_linears(*modules: nn.Module, backend: str | None = None) -> int:
    """Switch every plain fp32 CPU nn.Linear inside `modules` with at least MIN_ONEDNN_NUMEL weight elements to
    OneDnnLinear, in place (same module object, same Parameters). Returns how many switched; 0 when the
    backend is "aten", oneDNN is missing, or nothing qualifies (GPU, bf16, quantized, sharded or already switched
    linears)."""
    backend = backend or default_backend()
    if backend not in BACKENDS:
        raise ValueError(f"cpu gemm backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if backend == "aten" or not onednn_available():
        return 0
    switched = 0
    for root in modules:
        for module in root.modules():
            if type(module) is nn.Linear and _takes_onednn(module.weight):
                # Only forward differs, so a class swap keeps the module's identity for everything that holds
                # it (the decoder layer, the morph LayerStore's fp variant, the tied embedding).
                module.__class__ = OneDnnLinear
                switched += 1
    return switched
