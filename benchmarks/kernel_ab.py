"""Two builds of a linear-product kernel side by side in one process: a git revision's source against the working
tree's, on the same weights in the kernel's layout, in alternating rounds. Between processes this 2-core machine's
speed moves by up to ~1.5x (the same product at 30 rows took 23 ms in one run, 34-40 in another), so a kernel change
is judged here, not by two runs of benchmarks/decode_gemm.py.

    python benchmarks/kernel_ab.py --base REV [--kernel decode_gemm|quant_gemm] [--dtype float32|bfloat16]
                                   [--bits 8|4] [--rows 1 4 8 16 32 64] [--rounds 9] [--shape smollm2-135m]

decode_gemm (native/decode_gemm.c, fp32 or bf16 weights): every decoder layer's linears and the LM head of the named
model's shapes; quant_gemm (native/quant_gemm.c, W8 or W4 with groups of 64, fp32 activations): the decoder layers'
linears, as a morphed layer runs them. Random weights, torch's threads. Checks that both builds give the same bits
and prints per row count the medians [min-max] and RESULT kernel_ab_speedup_<variant>_m<M>: base time / working
tree time (> 1: the working tree is faster).
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROJECT_ROOT, machine_description  # noqa: E402
from decode_gemm import linear_shapes  # noqa: E402
from model_shapes import SHAPES  # noqa: E402

from elastic_hf.layers.w4_linear import W4Linear  # noqa: E402
from elastic_hf.layers.w8_linear import W8Linear  # noqa: E402
from elastic_hf.native.build import SOURCE_DIR, build_source  # noqa: E402
from elastic_hf.native.decode_gemm import bf16_dot_chosen, packed_layout, reads_layout  # noqa: E402
from elastic_hf.native.quant_gemm import quant_gemm_supports  # noqa: E402

W4_GROUP = 64
P, I64 = ctypes.c_void_p, ctypes.c_int64


def base_source(kernel: str, rev: str, into: Path) -> Path:
    """The kernel's source and the package's headers at git revision `rev`, written under `into`."""
    native = SOURCE_DIR.relative_to(PROJECT_ROOT)
    names = [f"{kernel}.c"] + [h.name for h in SOURCE_DIR.glob("*.h")]
    for name in names:
        text = subprocess.run(["git", "show", f"{rev}:{native / name}"], cwd=PROJECT_ROOT, capture_output=True,
                              check=True).stdout
        (into / name).write_bytes(text)
    return into / f"{kernel}.c"


def decode_gemm_runner(lib: ctypes.CDLL, dtype: torch.dtype):
    """(w, x, y, n, k, rows, threads) -> status of the library's decode_gemm entry point for `dtype`: for bf16 the
    one the engine takes on this CPU (vdpbf16ps where the build has it and native/decode_gemm.py's probe chose it,
    else the widened fp32 FMAs)."""
    name = "elastic_decode_gemm_f32" if dtype == torch.float32 else "elastic_decode_gemm_bf16"
    if dtype == torch.bfloat16 and bf16_dot_chosen() and hasattr(lib, name + "_dot"):
        name += "_dot"
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = [P, I64, P, P, P, I64, I64, I64, I64, ctypes.c_int], ctypes.c_int
    return lambda w, x, y, n, k, rows, threads: fn(x.data_ptr(), k, w.data_ptr(), None, y.data_ptr(), n, rows, n,
                                                    k, threads)


def quant_gemm_runner(lib: ctypes.CDLL, bits: int):
    """The same for the library's quant_gemm on a W8Linear / W4Linear's blocked buffers (fp32 x and y)."""
    fn = lib.elastic_quant_gemm
    fn.argtypes = [P, I64, ctypes.c_int, P, ctypes.c_int, P, P, I64, P, P, I64, I64, I64, I64, ctypes.c_int]
    fn.restype = ctypes.c_int

    def run(layer, x, y, n, k, rows, threads):
        if bits == 8:
            weight, scale, sz, group = layer.qweight, layer.scales.data_ptr(), None, 0
        else:
            weight, scale, sz, group = layer.weight_packed, None, layer.scales_and_zeros.data_ptr(), W4_GROUP
        return fn(x.data_ptr(), k, 0, weight.data_ptr(), bits, scale, sz, group, None, y.data_ptr(), n, rows, n, k,
                  threads)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True, help="git revision whose decode_gemm.c is the baseline")
    parser.add_argument("--kernel", default="decode_gemm", choices=("decode_gemm", "quant_gemm"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="decode_gemm's weights")
    parser.add_argument("--bits", type=int, default=8, choices=(8, 4), help="quant_gemm's weights")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per row count (>= 3)")
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    layer, num_layers, head = linear_shapes(args.shape)
    threads = torch.get_num_threads()
    print(machine_description(), f"threads={threads}", flush=True)
    torch.manual_seed(0)
    if args.kernel == "decode_gemm":
        shapes = layer * num_layers + [head]
        if not all(reads_layout(n, k, dtype) for n, k in shapes):
            sys.exit(f"no {args.dtype} decode_gemm kernel for {args.shape}'s shapes on this CPU")
        weights = [packed_layout((torch.randn(n, k) * 0.02).to(dtype)) for n, k in tqdm(shapes, desc="packing")]
        tag, what = ("fp32" if dtype == torch.float32 else "bf16"), "layers x 4 linears + head"
    else:
        shapes, dtype = layer * num_layers, torch.float32
        if not all(quant_gemm_supports(n, k, "cpu", None if args.bits == 8 else W4_GROUP) for n, k in shapes):
            sys.exit(f"no quant_gemm kernel for {args.shape}'s shapes on this CPU")
        make = (lambda w: W8Linear.from_weight(w)) if args.bits == 8 else (lambda w: W4Linear.from_weight(w, W4_GROUP))
        weights = [make(torch.randn(n, k) * 0.02) for n, k in tqdm(shapes, desc=f"quantizing to W{args.bits}")]
        tag, what = f"w{args.bits}", f"layers x 4 linears in W{args.bits}"
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"base": build_source(base_source(args.kernel, args.base, Path(tmp))),
                "tree": build_source(SOURCE_DIR / f"{args.kernel}.c")}
    runner = (lambda lib: decode_gemm_runner(lib, dtype)) if args.kernel == "decode_gemm" else \
        (lambda lib: quant_gemm_runner(lib, args.bits))
    builds = {name: runner(lib) for name, lib in libs.items()}
    flops_per_row = 2 * sum(n * k for n, k in shapes)
    print(f"{args.shape} {args.kernel}: {num_layers} {what}; base {args.base} vs the working tree")
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}
        outputs = [torch.empty(rows, n, dtype=dtype) for n, _ in shapes]

        def run(fn) -> list[torch.Tensor]:
            for w, (n, k), y in zip(weights, shapes, outputs):
                status = fn(w, inputs[k], y, n, k, rows, threads)
                if status != 0:
                    raise RuntimeError(f"{args.kernel} returned {status} for [{rows}, {k}] x [{n}, {k}]")
            return [y.clone() for y in outputs]

        results = {name: run(fn) for name, fn in builds.items()}
        if not all(torch.equal(a, b) for a, b in zip(results["base"], results["tree"])):
            print(f"M={rows}: the builds' outputs differ (a change of summation order?)")
        times: dict[str, list[float]] = {name: [] for name in builds}
        for _ in tqdm(range(max(3, args.rounds)), desc=f"M={rows}", leave=False):
            for name, fn in builds.items():
                start = time.perf_counter()
                run(fn)
                times[name].append(time.perf_counter() - start)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        cells = "   ".join(f"{name} {med[name] * 1e3:8.2f} ms [{min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}] "
                           f"({flops_per_row * rows / med[name] / 1e9:5.1f} GFLOP/s)" for name, ts in times.items())
        print(f"M={rows:4d}  {cells}   x{med['base'] / med['tree']:.3f}", flush=True)
        print(f"RESULT kernel_ab_speedup_{tag}_m{rows} {med['base'] / med['tree']:.3f}")


if __name__ == "__main__":
    main()
