"""One layer's causal prefill attention of the default model's shape (9 query heads over 3 KV heads, head_dim 64):
SDPA's CPU flash kernel (what a fresh prompt ran through before) against the native kernel
(elastic_hf/native/causal_prefill.c), on q/k/v viewed out of one packed projection as the engine hands them over.

    python benchmarks/prefill_attention.py [--dtype {float32,bfloat16}] [--lengths 128 460 1024] [--repeats 20]
                                           [--base REV]

Prints a table and `RESULT prefill_attention_speedup_t<T> <SDPA time / native time>` per prompt length, and the
largest difference between the two outputs. With --base, a git revision's causal_prefill.c is built beside the
working tree's and both are timed in alternating calls in this process (this 2-core machine's speed moves between
processes by more than a kernel change): `RESULT prefill_attention_vs_base_t<T> <base time / working tree time>`.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64


def base_kernel(rev: str, dtype: torch.dtype, into: Path):
    """Revision `rev`'s build of the kernel entry for `dtype`, with the working tree's ctypes signature."""
    from kernel_ab import base_source

    from elastic_hf.native import causal_prefill
    from elastic_hf.native.build import build_source

    fn = getattr(build_source(base_source("causal_prefill", rev, into)),
                 f"elastic_causal_prefill_varlen_{causal_prefill.KERNEL_DTYPES[dtype]}")
    fn.argtypes, fn.restype = causal_prefill._ARGTYPES, causal_prefill._int
    return fn


@contextlib.contextmanager
def kernel_swapped(fn):
    """The binding's kernel lookup answers `fn` meanwhile (the caller then runs the same Python path into it)."""
    from elastic_hf.native import causal_prefill

    original = causal_prefill._kernel
    causal_prefill._kernel = lambda dtype=torch.float32: fn
    try:
        yield
    finally:
        causal_prefill._kernel = original


def alternating_ms(fns: dict, repeats: int) -> dict[str, float]:
    """Median ms of each function, called in turn `repeats` times after one warm-up call each."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def timed_ms(fn, repeats: int) -> float:
    fn()   # warm-up: builds the library, touches the buffers
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 460, 1024])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--base", default=None, metavar="REV", help="also time this git revision's kernel build")
    args = parser.parse_args()

    from elastic_hf.native.causal_prefill import causal_prefill_attention, native_prefill_available

    dtype = getattr(torch, args.dtype)
    if not native_prefill_available(dtype, torch.device("cpu")):
        print("the native kernel is not available here (no C compiler, or ELASTIC_HF_NATIVE=0)")
        return 1
    scale = HEAD_DIM ** -0.5
    base = None
    if args.base:
        with tempfile.TemporaryDirectory() as tmp:
            base = base_kernel(args.base, dtype, Path(tmp))
    print(f"machine: {machine_description()}; {args.dtype}, {NUM_HEADS} heads / {NUM_KV_HEADS} KV heads, "
          f"head_dim {HEAD_DIM}, median of {args.repeats}")
    print(f"{'tokens':>7s} {'SDPA ms':>9s} {'native ms':>10s} {'speedup':>8s} {'GFLOP/s':>8s} {'max diff':>9s}"
          + (f" {'base ms':>9s} {'vs base':>8s}" if base else ""))
    for length in args.lengths:
        torch.manual_seed(length)
        packed = torch.randn(length, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM).to(dtype)   # q | k | v columns
        q = packed[:, :NUM_HEADS * HEAD_DIM].view(length, NUM_HEADS, HEAD_DIM)
        k = packed[:, NUM_HEADS * HEAD_DIM:(NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM].view(length, NUM_KV_HEADS, HEAD_DIM)
        v = packed[:, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM:].view(length, NUM_KV_HEADS, HEAD_DIM)
        out = torch.empty(length, NUM_HEADS, HEAD_DIM, dtype=dtype)

        def sdpa():   # as the engine called it: 4-D, causal, GQA
            return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                  v.transpose(0, 1)[None], is_causal=True, scale=scale,
                                                  enable_gqa=True)[0].transpose(0, 1)

        def native():
            causal_prefill_attention(q, k, v, out, scale)

        def native_base():
            with kernel_swapped(base):
                causal_prefill_attention(q, k, v, out, scale)

        t_sdpa = timed_ms(sdpa, args.repeats)
        timed = alternating_ms({"tree": native, "base": native_base} if base else {"tree": native}, args.repeats)
        t_native = timed["tree"]
        native()
        diff = (out.float() - sdpa().float()).abs().max().item()
        flops = 4 * NUM_HEADS * HEAD_DIM * length * (length + 1) / 2   # QK^T and PV over the causal half
        print(f"{length:7d} {t_sdpa:9.3f} {t_native:10.3f} {t_sdpa / t_native:8.2f} "
              f"{flops / t_native / 1e6:8.1f} {diff:9.2e}"
              + (f" {timed['base']:9.3f} {timed['base'] / t_native:8.2f}" if base else ""))
        print(f"RESULT prefill_attention_speedup_t{length} {t_sdpa / t_native:.3f}")
        if base:
            print(f"RESULT prefill_attention_vs_base_t{length} {timed['base'] / t_native:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
