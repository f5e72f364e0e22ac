"""CPU linears, fp32 and bf16: ATen (F.linear), oneDNN on the plain weight (torch.ops.mkldnn._linear_pointwise) and
oneDNN on a prepacked weight (torch.ops.mkldnn._reorder_linear_weight), the default model's weight shapes at
M = 1, 4, 32 (decode steps) and 512 (a prefill chunk), side by side. elastic_hf.layers.cpu_gemm and
elastic_hf.layers.packed_linear choose per weight (see their docstrings for the figures).

    python benchmarks/cpu_gemm.py [--threads N] [--ms 1 4 32 512] [--dtypes float32 bfloat16]

RESULT onednn_layer_speedup_m<M>: one decoder layer's fp32 linears, ATen / unpacked oneDNN choice;
RESULT packed_layer_speedup[_bf16]_m<M>: the same layer, without packing / with packing (the engine's default on
one worker without morphing).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

from elastic_hf.layers.cpu_gemm import MIN_ONEDNN_NUMEL  # noqa: E402
from elastic_hf.layers.packed_linear import PACK_BATCH_HINT, packing_available, takes_packing  # noqa: E402

# SmolLM2-135M: q/o, k/v, gate/up, down, LM head (tied embedding)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def best_time(fn, min_seconds: float = 0.2) -> float:
    fn()
    reps, elapsed = 1, 0.0
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / reps
        reps *= 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 4, 32, 512], help="rows of the activation")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not packing_available():
        raise SystemExit("this torch build has no oneDNN linear with weight packing")
    print(f"machine: {machine_description()}")
    torch.manual_seed(0)
    results = []
    print(f"{'dtype':>8} {'M':>4} {'weight':>12} {'aten us':>10} {'oneDNN us':>10} {'packed us':>10}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for m in tqdm(args.ms, desc=dtype_name):
            layer = {"aten": 0.0, "unpacked": 0.0, "packed": 0.0}
            for out_features, in_features in SHAPES:
                weight = (torch.randn(out_features, in_features) * 0.02).to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
                x = torch.randn(1, m, in_features).to(dtype)
                aten = best_time(lambda: F.linear(x, weight))
                onednn = best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
                prepacked = best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
                tqdm.write(f"{dtype_name:>8} {m:>4} {out_features:>5} x {in_features:<5} {aten * 1e6:10.1f} "
                           f"{onednn * 1e6:10.1f} {prepacked * 1e6:10.1f}")
                # One decoder layer runs q, k, v, o, gate, up, down: each shape once, k/v and gate/up twice.
                count = {(576, 576): 2, (192, 576): 2, (1536, 576): 2, (576, 1536): 1}.get(
                    (out_features, in_features), 0)
                module = nn.Linear(in_features, out_features, bias=False).to(dtype)
                # what elastic-hf ran before packing: oneDNN for fp32 weights >= 576 x 576, ATen otherwise
                unpacked = onednn if dtype == torch.float32 and weight.numel() >= MIN_ONEDNN_NUMEL else aten
                layer["aten"] += count * aten
                layer["unpacked"] += count * unpacked
                layer["packed"] += count * (prepacked if takes_packing(module) else unpacked)
            results.append((dtype_name, m, layer))
            tqdm.write(f"{dtype_name:>8} {m:>4} one decoder layer's linears: aten {layer['aten'] * 1e6:.0f} us, "
                       f"unpacked {layer['unpacked'] * 1e6:.0f} us, packed {layer['packed'] * 1e6:.0f} us")
    for dtype_name, m, layer in results:
        suffix = "" if dtype_name == "float32" else "_bf16"
        if dtype_name == "float32":
            print(f"RESULT onednn_layer_speedup_m{m} {layer['aten'] / layer['unpacked']:.3f}")
        print(f"RESULT packed_layer_speedup{suffix}_m{m} {layer['unpacked'] / layer['packed']:.3f}")


if __name__ == "__main__":
    main()
