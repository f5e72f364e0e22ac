"""fp32 linear on CPU: ATen (F.linear -> MKL sgemm) vs oneDNN (torch.ops.mkldnn._linear_pointwise), the default
model's weight shapes at M = 1, 32 (a decode step of 32 sequences) and 512 (a prefill chunk), side by side.
elastic_hf.layers.cpu_gemm switches the linears where oneDNN wins (see its docstring for the figures).

    python benchmarks/cpu_gemm.py [--threads N] [--ms 1 32 512]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

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
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 32, 512], help="rows of the activation")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        raise SystemExit("this torch build has no oneDNN linear")
    print(f"machine: {machine_description()}")
    torch.manual_seed(0)
    layer_ratio = {}
    print(f"{'M':>4} {'weight':>12} {'aten us':>10} {'oneDNN us':>10} {'aten/oneDNN':>12}")
    for m in tqdm(args.ms, desc="M"):
        aten_layer = onednn_layer = 0.0
        for out_features, in_features in SHAPES:
            weight = torch.randn(out_features, in_features) * 0.02
            x = torch.randn(1, m, in_features)
            aten = best_time(lambda: F.linear(x, weight))
            onednn = best_time(lambda: torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], ""))
            tqdm.write(f"{m:>4} {out_features:>5} x {in_features:<5} {aten * 1e6:10.1f} {onednn * 1e6:10.1f} "
                       f"{aten / onednn:12.2f}")
            # One decoder layer runs q, k, v, o, gate, up, down: each shape once, k/v and gate/up twice.
            count = {(576, 576): 2, (192, 576): 2, (1536, 576): 2, (576, 1536): 1}.get((out_features, in_features), 0)
            aten_layer += count * aten
            # what elastic-hf runs: oneDNN for weights >= 576 x 576, ATen for the small K/V projections
            onednn_layer += count * (onednn if out_features * in_features >= 576 * 576 else aten)
        layer_ratio[m] = aten_layer / onednn_layer
        tqdm.write(f"{m:>4} one decoder layer's linears: aten {aten_layer * 1e6:.0f} us, elastic-hf's choice "
                   f"{onednn_layer * 1e6:.0f} us ({layer_ratio[m]:.2f}x)")
    for m, ratio in layer_ratio.items():
        print(f"RESULT onednn_layer_speedup_m{m} {ratio:.3f}")


if __name__ == "__main__":
    main()
