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

oneDNN's bf16 results are bit-identical to `F.linear` for every M tried (1 to 512); fp32 ones differ in the last
bits (~1e-6 relative), as the unpacked oneDNN path (layers/cpu_gemm.py) already does.

Where our own kernel reads oneDNN's packed layout (native/decode_gemm.c: AVX-512, shapes in whole 64-output blocks,
the layout checked per shape), it runs the product instead of oneDNN's inner product, from the same packed bytes:
faster or level at every row count measured, most in bf16 (its docstring has the figures; ELASTIC_HF_DECODE_GEMM=0
turns it off). Its bf16 outputs differ from oneDNN's in the last bit of ~0.05 % of outputs. The packed tensor is an opaque
MKLDNN tensor with exactly the plain weight's byte count; torch cannot build one over an existing buffer, so it
lives in the CPU allocator, outside the weights arena. PlacedWeights.pack_linears therefore decommits the arena
pages of every packed weight nobody else reads and charges the packed bytes to the ledger: memory stays the same
and the ledger stays true. A weight shared with another module (a tied LM head is the embedding table) keeps its
plain copy, and its packed copy is extra, counted memory.

Packing into oneDNN's allocations needs the plain weight to stay untouched for good, so it is for deployments whose
weights never change after load: one worker (no TP shards, no pipeline stages, no reshapes). A morphing instance's
decoder layers pack in their own arena bytes instead (pack_linear_in_place / pack_group_in_place, below)
(EngineConfig.packed_weights), and so does a bf16 instance on a CPU where oneDNN packs no bf16 (packs_in_place_instead:
AVX2-only, where our kernel's AVX2 build reads the layout)."""
from __future__ import annotations

import sys

import torch
from torch import nn

from elastic_hf.layers.cpu_gemm import MIN_ONEDNN_NUMEL, OneDnnLinear, default_backend, onednn_available
from elastic_hf.native.decode_gemm import (bf16_dot_chosen, decode_gemm, decode_gemm_available, packed_data_ptr,
                                           packed_layout, reads_layout, reads_packed)

# oneDNN picks the blocked layout for this many rows; measured equally good from decode (M=1) to prefill (M=512).
PACK_BATCH_HINT = 32
# From this many rows an fp32 product goes to oneDNN's inner product even where our kernel can read the weight: there
# the product is compute-bound and oneDNN's fp32 kernel the faster one (the default model's 30 layers of linears,
# 2 threads, ours / oneDNN: 96 rows 62.7 / 66.7 ms, 128 rows 86.8 / 84.9, 200 rows 143 / 135, 465 rows 340 / 301,
# 1000 rows 741 / 656).
ONEDNN_FP32_FROM_ROWS = 128
# The same for bf16 where our kernel runs on vdpbf16ps (native/decode_gemm.py bf16_dot_chosen: it issues at an FMA's
# rate there, so oneDNN's brgemm, built on it, is fast too and blocks a prefill's rows better. oneDNN time / ours on
# AMD Zen 4 (benchmarks/decode_gemm.py): default model 96 rows 1.09, 128 rows 0.98-1.03, 256 rows 0.88, 512 rows 0.89;
# Llama-3.2-1B's shapes 32 rows 1.10, 64 rows 0.90, 128 rows 0.86, 512 rows 0.85. Where vdpbf16ps runs at half rate
# (the Xeon of session 45) ours is ahead at every row count and bf16 stays on it.
ONEDNN_BF16_DOT_FROM_ROWS = 128


def packing_available() -> bool:
    """oneDNN with its weight reorder, and the CPU GEMM backend not forced to ATen (ELASTIC_HF_CPU_GEMM=aten)."""
    return (onednn_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and default_backend() == "onednn")


class PackedLinear(nn.Linear):
    """An nn.Linear whose forward reads `packed_weight` (oneDNN layout). Its `weight` Parameter may have been
    replaced by a meta tensor of the same shape once its pages went back (see PlacedWeights.pack_linears)."""

    packed_weight: torch.Tensor
    direct: DirectProduct | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., in_features] -> [..., out_features]
        return packed_product(x, self.packed_weight, self.bias, self.direct)


def packed_product(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   direct: DirectProduct | None) -> torch.Tensor:
    """x @ W.T (+ bias) for a oneDNN-packed W: native/decode_gemm.c where `direct` is its handle on W and x has W's
    dtype, below `direct.onednn_from_rows` rows, else oneDNN's inner product. [..., in] -> [..., out]."""
    if direct is not None and direct.runs(x.dtype, x.numel() // x.shape[-1]):
        return decode_gemm(x, direct.weight_ptr, bias, direct.out_features)
    if direct is not None and direct.in_arena:   # no oneDNN tensor to fall back on
        raise TypeError(f"a linear packed in the weights arena multiplies {direct.dtype} inputs only, got {x.dtype}")
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


class DirectProduct:
    """What native/decode_gemm.c needs to read a packed weight itself: the buffer's address (taken once: asking
    oneDNN for it costs an op dispatch, and this runs for every linear of every step), dtype and output size. It
    holds the packed tensor, so the address stays valid while it lives (an opaque oneDNN tensor cannot be deep-copied
    or pickled, so neither can a packed linear: no copy can keep a stale address)."""

    __slots__ = ("packed", "weight_ptr", "dtype", "out_features", "in_arena", "onednn_from_rows")

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype, out_features: int):
        self.packed, self.dtype, self.out_features = packed, dtype, out_features
        # A plain tensor holding the packed bytes (pack_in_place: the weights arena) has no oneDNN twin: every row
        # count runs the native kernel (a few % behind oneDNN's from ONEDNN_*_FROM_ROWS rows).
        self.in_arena = not packed.is_mkldnn
        self.weight_ptr = packed.data_ptr() if self.in_arena else packed_data_ptr(packed)
        self.onednn_from_rows = _onednn_from_rows(dtype) if not self.in_arena else sys.maxsize

    def runs(self, dtype: torch.dtype, rows: int) -> bool:
        """Whether the native kernel, not oneDNN, multiplies `rows` rows of `dtype` by this weight."""
        return dtype == self.dtype and rows < self.onednn_from_rows


def _onednn_from_rows(dtype: torch.dtype) -> int:
    """Row count from which a product with a oneDNN twin goes to oneDNN (sys.maxsize: never)."""
    if dtype == torch.float32:
        return ONEDNN_FP32_FROM_ROWS
    return ONEDNN_BF16_DOT_FROM_ROWS if dtype == torch.bfloat16 and bf16_dot_chosen() else sys.maxsize


def direct_product(packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype,
                   bias: torch.Tensor | None) -> DirectProduct | None:
    """The native kernel's handle on `packed` ([out, in] in oneDNN's layout) where it reads that layout (and the
    bias, if any, is a contiguous vector of the weight's dtype), else None: oneDNN's inner product then runs it."""
    if bias is not None and (bias.dtype != dtype or not bias.is_contiguous() or bias.device.type != "cpu"):
        return None
    if not reads_packed(out_features, in_features, dtype, PACK_BATCH_HINT):
        return None
    return DirectProduct(packed, dtype, out_features)


def takes_packing(module: nn.Module) -> bool:
    """A plain (or oneDNN) CPU linear in bf16, or in fp32 when large enough for oneDNN to win at all (the rule of
    layers/cpu_gemm.py); quantized, sharded, fp16 and GPU linears keep their own kernels."""
    return _is_plain_cpu_linear(module) and _packs(module.weight.dtype, module.weight.numel())


def _is_plain_cpu_linear(module: nn.Module) -> bool:
    return type(module) in (nn.Linear, OneDnnLinear) and module.weight.device.type == "cpu"


def _packs(dtype: torch.dtype, numel: int) -> bool:
    return ((dtype == torch.bfloat16 and bf16_packing_available())
            or (dtype == torch.float32 and numel >= MIN_ONEDNN_NUMEL))


def bf16_packing_available() -> bool:
    """oneDNN's bf16 reorder and inner product need AVX512-BW/VL/DQ or AVX-NE-CONVERT: on an AVX2-only CPU (seen on
    this project's CI machines too) `_reorder_linear_weight` refuses bf16, so bf16 linears keep their plain
    weights there (ATen's bf16 GEMM)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


@torch.no_grad()
def pack_linear(module: nn.Linear) -> int:
    """Give `module` its packed weight and switch it to PackedLinear, in place (same module object). Returns the
    packed tensor's bytes."""
    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_BATCH_HINT)
    module.packed_weight = packed
    module.direct = direct_product(packed, module.out_features, module.in_features, module.weight.dtype,
                                   module.bias)
    module.__class__ = PackedLinear
    return int(torch.ops.mkldnn._nbytes(packed))


# ---------------------------------------------------------------- fused projections
# Linears that read the same input (a layer's q/k/v, its gate/up) run as one GEMM over their weights stacked on
# the output axis, as vLLM's QKVParallelLinear and MergedColumnParallelLinear do: one oneDNN call instead of three
# (or two), no small K/V products that the kernel's per-call cost dominates, and one module dispatch where the
# input is read. HF's modeling code still calls q_proj, k_proj and v_proj in turn; the first call for an input
# computes the fused product and every member returns its column slice of it.

class FusedProduct:
    """The stacked weight of a fusion group (oneDNN-packed, or plain: layers/stacked_linear.py) and the product of
    its last input, held until every member has read its slice (a prefill's product must not outlive its step)."""

    def __init__(self, packed_weight: torch.Tensor, bias: torch.Tensor | None, num_members: int,
                 packed: bool = True):
        self.packed_weight = packed_weight   # [sum(out), in]: oneDNN's blocked layout when `packed`, else plain
        self.bias = bias
        self.num_members = num_members
        self.packed = packed
        # the native kernel's handle on a packed weight it can read (set by pack_fused), else None
        self.direct: DirectProduct | None = None
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self._unread = 0

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The whole product for a caller that reads every member's columns itself (layers/swiglu_mlp.py):
        [..., in_features] -> [..., sum of the members' out_features], nothing held."""
        if not self.packed:
            return nn.functional.linear(x, self.packed_weight, self.bias)
        return packed_product(x, self.packed_weight, self.bias, self.direct)

    def read(self, x: torch.Tensor) -> torch.Tensor:
        """The fused product of x: [..., in_features] -> [..., sum of the members' out_features]. Recomputed
        unless x is the very tensor of the last product that still has unread members. (Identity, not a version
        counter: inference tensors have none. HF computes a layer's projections back to back from one tensor that
        nothing writes in between; the product holds x, so its id cannot be reused meanwhile.)"""
        if self._unread == 0 or x is not self._input:
            self._output = self.product(x)
            self._input, self._unread = x, self.num_members
        output = self._output
        self._unread -= 1
        if self._unread == 0:
            self._input = self._output = None
        return output


class FusedMemberLinear(nn.Linear):
    """One member of a fusion group: its output is columns [column_start, column_start + out_features) of the
    group's product. Its `weight` is a meta tensor of its own shape once the arena pages went back."""

    fused: FusedProduct
    column_start: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., in_features] -> [..., out_features], a view of the group's product (its rows stay contiguous)
        return self.fused.read(x)[..., self.column_start:self.column_start + self.out_features]


def fusable(group: list[nn.Module]) -> bool:
    """Members that can share one GEMM: plain CPU linears of one dtype and input size, all with a bias or none,
    whose stacked weight packs (in fp32 the rule is on the stacked size: small K/V projections join q's)."""
    first = group[0]
    return (len(group) > 1 and all(_is_plain_cpu_linear(m) for m in group)
            and all(m.weight.dtype == first.weight.dtype and m.in_features == first.in_features for m in group)
            and len({m.bias is None for m in group}) == 1
            and _packs(first.weight.dtype, sum(m.weight.numel() for m in group)))


@torch.no_grad()
def pack_fused(group: list[nn.Linear]) -> int:
    """Stack the group's weights [sum(out), in], pack them once and switch every member to FusedMemberLinear, in
    place. Returns the bytes it holds: the packed tensor (the members' plain bytes together) and the stacked bias."""
    stacked = torch.cat([m.weight.detach() for m in group], dim=0)           # [sum(out_features), in_features]
    bias = None if group[0].bias is None else torch.cat([m.bias.detach() for m in group])
    packed = torch.ops.mkldnn._reorder_linear_weight(stacked, PACK_BATCH_HINT)
    product = FusedProduct(packed, bias, len(group))
    product.direct = direct_product(packed, stacked.shape[0], stacked.shape[1], stacked.dtype, bias)
    del stacked
    make_members(group, product)
    return int(torch.ops.mkldnn._nbytes(packed)) + (0 if bias is None else bias.numel() * bias.element_size())


def make_members(group: list[nn.Linear], product: FusedProduct) -> None:
    """Switch every linear of `group` to FusedMemberLinear over `product`, in place: member i reads the columns
    after those of members 0..i-1."""
    start = 0
    for module in group:
        module.fused, module.column_start = product, start
        module.__class__ = FusedMemberLinear
        start += module.out_features


# ---------------------------------------------------------------- packed in place (precision morphing)
# A morphing instance swaps each decoder layer's bytes in and out of its fp range of the weights arena (morph/
# layer_swapper.py), so its fp weights cannot move into oneDNN's own allocations. They need not: our kernel reads
# the packed layout from any address, and for shapes it reads the layout is a permutation of the plain weight's
# bytes (native/decode_gemm.packed_layout). Rewritten in place, before the morph store captures each fp range's
# image, a restored layer gets the packed bytes back at the same addresses; memory does not change.

def packs_in_place(out_features: int, in_features: int, dtype: torch.dtype) -> bool:
    """Whether an [out, in] `dtype` weight can be rewritten in place into the layout native/decode_gemm.c reads."""
    return dtype in (torch.float32, torch.bfloat16) and reads_layout(out_features, in_features, dtype)


def packs_in_place_instead(dtype: torch.dtype) -> bool:
    """Whether a one-worker instance packs its `dtype` linears in their own arena bytes rather than into oneDNN's
    allocations: bf16 where oneDNN packs no bf16 (an AVX2-only CPU) but our kernel is built (AVX2 + FMA)."""
    return dtype == torch.bfloat16 and not bf16_packing_available() and decode_gemm_available(dtype)


@torch.no_grad()
def _permute_in_place(weight: torch.Tensor) -> DirectProduct:
    """Rewrite a contiguous [out, in] weight's own bytes into the kernel's layout; the handle reads them there."""
    flat = weight.view(-1)
    flat.copy_(packed_layout(weight))   # packed_layout permutes into a new tensor first: no aliasing
    return DirectProduct(flat, weight.dtype, weight.shape[0])


def takes_packing_in_place(module: nn.Module) -> bool:
    """A plain CPU linear with a contiguous weight the kernel reads in place (packs_in_place) and no bias or a
    contiguous one of the weight's dtype (the kernel adds it)."""
    if not (_is_plain_cpu_linear(module) and module.weight.is_contiguous()
            and packs_in_place(module.out_features, module.in_features, module.weight.dtype)):
        return False
    bias = module.bias
    return bias is None or (bias.dtype == module.weight.dtype and bias.is_contiguous())


def meta_parameter(weight: torch.Tensor) -> nn.Parameter:
    """A meta Parameter of `weight`'s shape and dtype: what a packed linear keeps where its plain weight was, so a
    stray read of the plain weight fails instead of reading permuted bytes or pages given back."""
    return nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"), requires_grad=False)


def pack_linear_in_place(module: nn.Linear) -> None:
    """Switch a linear that takes packing in place (takes_packing_in_place) to PackedLinear over its own bytes."""
    if not takes_packing_in_place(module):
        raise ValueError(f"{type(module).__name__} [{module.out_features}, {module.in_features}] "
                         f"{module.weight.dtype} cannot be packed in place")
    direct = _permute_in_place(module.weight.detach())
    module.packed_weight, module.direct = direct.packed, direct
    module.__class__ = PackedLinear


def pack_group_in_place(group: list[nn.Linear], stacked: torch.Tensor) -> None:
    """Switch a stackable group (layers/stacked_linear.py) to FusedMemberLinear over one product whose weight is
    `stacked`, the [sum(out), in] view over the members' back-to-back bytes, rewritten there into the packed layout."""
    direct = _permute_in_place(stacked)
    product = FusedProduct(direct.packed, None, len(group))
    product.direct = direct
    make_members(group, product)
