"""A whole model's linears (every decoder layer's fused q/k/v, o, fused gate/up and down, then the LM head) on
oneDNN-packed weights: oneDNN's inner product against native/decode_gemm.c reading the same packed bytes, at decode
row counts (and a prefill chunk), side by side in alternating rounds, against the machine's read bandwidth. On an
AVX2-only CPU (oneDNN's packing is not the kernel's layout there) the kernel reads weights packed on its own layout,
against what the engine would run otherwise: oneDNN's packed fp32, ATen's bf16 GEMM.

    python benchmarks/decode_gemm.py [--shape smollm2-135m|llama-3.2-1b|qwen2.5-0.5b|...] [--dtypes bfloat16 float32]
                                     [--rows 1 4 8 32 128] [--rounds 5]

Random weights in the named model's shapes (benchmarks/model_shapes.py); nothing is loaded. The bandwidth is a
2-thread fp32 `torch.sum` over a 1 GiB buffer (larger than the last-level cache), best of 5.
RESULT decode_gemm_speedup_<dtype>_m<M>: oneDNN's (or ATen's) time / the kernel's, median of the rounds;
RESULT decode_gemm_bandwidth_share_<dtype>_m1: (weight bytes / measured bandwidth) / the kernel's batch-1 time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402
from model_shapes import SHAPES  # noqa: E402

from elastic_hf.layers.packed_linear import PACK_BATCH_HINT, bf16_packing_available, packing_available  # noqa: E402
from elastic_hf.native.decode_gemm import (decode_gemm, decode_gemm_available, packed_data_ptr, packed_layout,  # noqa
                                           reads_layout, reads_packed)


def linear_shapes(shape: str) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """([out, in] of one decoder layer's packed linears, number of layers, [out, in] of the LM head) of a shape of
    benchmarks/model_shapes.py."""
    return config_linear_shapes(SHAPES[shape])


def config_linear_shapes(cfg: dict) -> tuple[list[tuple[int, int]], int, tuple[int, int]]:
    """The same from a config.json's fields (a model_shapes entry or a checkpoint's config as a dict)."""
    hidden, inter, heads = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg["num_key_value_heads"] * head_dim
    layer = [(q + 2 * kv, hidden), (hidden, q), (2 * inter, hidden), (hidden, inter)]
    return layer, cfg["num_hidden_layers"], (cfg["vocab_size"], hidden)


def read_bandwidth() -> float:
    """Bytes per second of a read-only stream over 1 GiB (fp32 sum on torch's threads), best of 5."""
    buffer = torch.ones(1 << 28)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 32, 128])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per row count (>= 3)")
    args = parser.parse_args()
    if not packing_available():
        sys.exit("this torch build has no oneDNN weight packing")
    print(machine_description(), f"threads={torch.get_num_threads()}", flush=True)
    bandwidth = read_bandwidth()
    print(f"read bandwidth: {bandwidth / 1e9:.1f} GB/s (fp32 sum over 1 GiB, best of 5)")
    layer, num_layers, head = linear_shapes(args.shape)
    for dtype in (getattr(torch, name) for name in args.dtypes):
        shapes = layer * num_layers + [head]
        if not decode_gemm_available(dtype) or not all(reads_layout(n, k, dtype) for n, k in shapes):
            print(f"{dtype}: no decode_gemm kernel for these shapes on this CPU; skipped")
            continue
        torch.manual_seed(0)
        plain = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in shapes]
        # The kernel reads oneDNN's own packed bytes where they are its layout (AVX-512); elsewhere (AVX2) weights
        # are packed in place on its layout, and the engine's alternative is oneDNN where it packs the dtype (fp32)
        # or ATen's GEMM over the plain weights (bf16: oneDNN packs none on AVX2)
        shared = all(reads_packed(n, k, dtype, PACK_BATCH_HINT) for n, k in shapes)
        onednn_packs = shared or dtype == torch.float32 or bf16_packing_available()
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT)
                  for w in tqdm(plain, desc=f"packing {dtype}", leave=False)] if onednn_packs else None
        own = None if shared else [packed_layout(w) for w in plain]
        pointers = [packed_data_ptr(p) for p in packed] if shared else [w.data_ptr() for w in own]
        baseline = "oneDNN" if onednn_packs else "ATen"
        nbytes = sum(n * k for n, k in shapes) * torch.finfo(dtype).bits // 8
        print(f"\n{args.shape} {dtype}: {num_layers} layers x {len(layer)} linears + head, "
              f"{nbytes / 1e6:.0f} MB of weights; bandwidth bound {nbytes / bandwidth * 1e3:.2f} ms; "
              f"kernel on {'oneDNN' if shared else 'its own'} packed bytes, against {baseline}")
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k).to(dtype) for _, k in shapes}

            def onednn():
                if packed is None:
                    for w, (_, k) in zip(plain, shapes):
                        torch.nn.functional.linear(inputs[k], w)
                    return
                for p, (_, k) in zip(packed, shapes):
                    torch.ops.mkldnn._linear_pointwise(inputs[k], p, None, "none", [], "")

            def native():
                for ptr, (n, k) in zip(pointers, shapes):
                    decode_gemm(inputs[k], ptr, None, n)

            times = {"onednn": [], "native": []}
            onednn(), native()
            for _ in tqdm(range(max(3, args.rounds)), desc=f"M={rows}", leave=False):
                for name, fn in (("onednn", onednn), ("native", native)):
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            med = {name: statistics.median(ts) for name, ts in times.items()}
            spread = {name: f"[{min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}]" for name, ts in times.items()}
            tag = f"{'bf16' if dtype == torch.bfloat16 else 'fp32'}_m{rows}"
            print(f"M={rows:4d}  {baseline} {med['onednn'] * 1e3:8.2f} ms {spread['onednn']} "
                  f"({nbytes / med['onednn'] / 1e9:5.1f} GB/s)   decode_gemm {med['native'] * 1e3:8.2f} ms "
                  f"{spread['native']} ({nbytes / med['native'] / 1e9:5.1f} GB/s)   x{med['onednn'] / med['native']:.2f}")
            print(f"RESULT decode_gemm_speedup_{tag} {med['onednn'] / med['native']:.3f}")
            if rows == 1:
                print(f"RESULT decode_gemm_bandwidth_share_{tag} {nbytes / bandwidth / med['native']:.3f}")


if __name__ == "__main__":
    main()
