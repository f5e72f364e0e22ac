"""W8 / W4 weight-only kernels vs fp32 and bf16 dense matmul on the default model's linear shapes.

For every shape (out x in) of SmolLM2-135M's decoder linears and M in {1, 16, 256} tokens, times
  fp32   x @ W^T                               (torch.nn.functional.linear)
  bf16   the same in bf16
  w8     per-output-channel int8                (native/quant_gemm.c on AVX-512 / AVX2 CPUs, else aten's int8 pack)
  w4     group-wise uint4, --group-size         (native/quant_gemm.c, else aten._weight_int4pack_mm[_for_cpu])
through the W8Linear / W4Linear modules (ELASTIC_HF_QUANT_GEMM=0: aten's kernels everywhere), and prints the bytes of each variant. Ratios are fp32 time / variant
time (> 1: the variant is faster). Ends with
  RESULT w4_bytes_ratio <fp32 bytes / w4 bytes over all shapes>
  RESULT w4_decode_speedup <fp32 time / w4 time at M = 1, summed over the shapes of one decoder layer>
"""
from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F

from elastic_hf.layers.w4_linear import W4Linear
from elastic_hf.layers.w8_linear import W8Linear

# (name, out_features, in_features, count per decoder layer)
SHAPES = [("q/o 576x576", 576, 576, 2), ("k/v 192x576", 192, 576, 2), ("gate/up 1536x576", 1536, 576, 2),
          ("down 576x1536", 576, 1536, 1)]
TOKENS = (1, 16, 256)


def time_call(fn, min_seconds: float, max_samples: int = 200) -> float:
    """Seconds per call: the minimum over samples of the mean of a batch of calls. The minimum, not the median,
    because this machine is shared: a descheduled thread adds a whole time slice (~20 ms) to a sample."""
    fn()
    t0 = time.perf_counter()
    fn()
    per_call = max(time.perf_counter() - t0, 1e-6)
    batch = max(1, min(1000, int(0.002 / per_call)))  # ~2 ms per sample
    best = float("inf")
    start = time.perf_counter()
    samples = 0
    while (time.perf_counter() - start < min_seconds or samples < 3) and samples < max_samples:
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        best = min(best, (time.perf_counter() - t0) / batch)
        samples += 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=64, help="W4 group size (must divide 576 and 1536)")
    parser.add_argument("--min-seconds", type=float, default=0.3, help="time budget per measurement")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1: on a shared 2-core machine a multi-threaded op "
                             "waits a whole scheduler time slice, ~20 ms, whenever the other core is busy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}; model: SmolLM2-135M-Instruct linear shapes; W4 group size {args.group_size}")
    print(f"{'shape':18}{'M':>5}{'fp32 us':>10}{'bf16 us':>10}{'w8 us':>10}{'w4 us':>10}"
          f"{'fp32/bf16':>10}{'fp32/w8':>9}{'fp32/w4':>9}")
    bytes_rows = []
    decode = {"fp32": 0.0, "w4": 0.0, "w8": 0.0, "bf16": 0.0}
    with torch.no_grad():
        for name, out_features, in_features, count in SHAPES:
            weight = torch.randn(out_features, in_features) * 0.02
            weight_bf16 = weight.bfloat16()
            w8 = W8Linear.from_weight(weight)
            w4 = W4Linear.from_weight(weight, args.group_size)
            bytes_rows.append((name, count, weight.numel() * 4, weight.numel() * 2, w8.nbytes, w4.nbytes))
            for tokens in TOKENS:
                x = torch.randn(tokens, in_features)
                x_bf16 = x.bfloat16()
                times = {
                    "fp32": time_call(lambda: F.linear(x, weight), args.min_seconds),
                    "bf16": time_call(lambda: F.linear(x_bf16, weight_bf16), args.min_seconds),
                    "w8": time_call(lambda: w8(x), args.min_seconds),
                    "w4": time_call(lambda: w4(x), args.min_seconds),
                }
                if tokens == 1:
                    for key in decode:
                        decode[key] += count * times[key]
                print(f"{name:18}{tokens:>5}" + "".join(f"{times[k] * 1e6:>10.1f}" for k in ("fp32", "bf16", "w8", "w4"))
                      + f"{times['fp32'] / times['bf16']:>10.2f}{times['fp32'] / times['w8']:>9.2f}"
                      f"{times['fp32'] / times['w4']:>9.2f}", flush=True)
    print(f"\n{'shape':18}{'x/layer':>8}{'fp32 B':>11}{'bf16 B':>11}{'w8 B':>11}{'w4 B':>11}{'fp32/w8':>9}{'fp32/w4':>9}")
    totals = [0, 0, 0, 0]
    for name, count, fp32_b, bf16_b, w8_b, w4_b in bytes_rows:
        for i, value in enumerate((fp32_b, bf16_b, w8_b, w4_b)):
            totals[i] += count * value
        print(f"{name:18}{count:>8}{fp32_b:>11}{bf16_b:>11}{w8_b:>11}{w4_b:>11}{fp32_b / w8_b:>9.2f}{fp32_b / w4_b:>9.2f}")
    print(f"{'one decoder layer':18}{'':>8}" + "".join(f"{t:>11}" for t in totals)
          + f"{totals[0] / totals[2]:>9.2f}{totals[0] / totals[3]:>9.2f}")
    print(f"\ndecode (M=1) time of one layer's linears: fp32 {decode['fp32'] * 1e6:.0f} us, bf16 "
          f"{decode['bf16'] * 1e6:.0f} us, w8 {decode['w8'] * 1e6:.0f} us, w4 {decode['w4'] * 1e6:.0f} us")
    print(f"RESULT w8_decode_speedup {decode['fp32'] / decode['w8']:.3f}")
    print(f"RESULT w4_bytes_ratio {totals[0] / totals[3]:.3f}")
    print(f"RESULT w4_decode_speedup {decode['fp32'] / decode['w4']:.3f}")


if __name__ == "__main__":
    main()
