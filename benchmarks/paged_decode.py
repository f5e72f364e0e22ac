"""Decode attention of one layer on CPU, fp32 or bf16 (--dtype): the pure-torch path (one index_select of whole K/V chunks, padded
to the longest context, then two bmm) vs the native kernel (elastic_hf/native/paged_decode.c, K/V read in place
from scattered pages, no padding), side by side on the default model's head shape.

    python benchmarks/paged_decode.py [--dtype {float32,bfloat16}] [--seqs 32] [--min-ctx 64 --max-ctx 160]
                                      [--threads N]

The contexts are spread like the throughput benchmark's mid-run (prompts 32-96 tokens plus 32 generated). The
native kernel is timed twice: on one layer, whose K/V stay in cache between calls, and on all 30 layers in turn, as
a decode step calls it, with every layer's K/V coming from DRAM (`RESULT paged_decode_native_us_every_layer[_bf16]`).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402
from cpu_gemm import best_time  # noqa: E402

from elastic_hf.kv.attention_backends import decode_attention  # noqa: E402
from elastic_hf.native.paged_decode import native_decode_available, paged_decode_attention  # noqa: E402

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16   # SmolLM2-135M, block_size 16


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="K/V and query dtype")
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--min-ctx", type=int, default=64)
    parser.add_argument("--max-ctx", type=int, default=160)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not native_decode_available(dtype, torch.device("cpu")):
        sys.exit("the native kernel is not available here (no C compiler, or ELASTIC_HF_NATIVE=0)")
    print(machine_description())

    torch.manual_seed(0)
    num_seqs = args.seqs
    lens = torch.randint(args.min_ctx, args.max_ctx + 1, (num_seqs,))
    max_blocks = -(-int(lens.max()) // BLOCK)
    chunks_per_block = NUM_LAYERS * NUM_KV_HEADS * 2
    num_blocks = 4 * num_seqs * max_blocks          # a pool larger than the batch: pages are scattered
    kv_chunks = torch.randn(num_blocks * chunks_per_block, BLOCK, HEAD_DIM).to(dtype)
    blocks = torch.randperm(num_blocks)[:num_seqs * max_blocks].view(num_seqs, max_blocks)
    head_kv = torch.arange(NUM_KV_HEADS * 2).view(NUM_KV_HEADS, 2)
    chunk_ids = (blocks[:, None, None, :] * chunks_per_block + head_kv[None, :, :, None]).flatten()
    layer_offset = 7 * NUM_KV_HEADS * 2
    ctx = max_blocks * BLOCK
    beyond = torch.arange(ctx)[None, :] >= lens[:, None]
    bias = torch.zeros(num_seqs, ctx, dtype=dtype).masked_fill_(beyond, float("-inf"))
    bias = bias[:, None, None, :].expand(num_seqs, NUM_KV_HEADS, 1, ctx).reshape(num_seqs * NUM_KV_HEADS, 1, ctx)
    q = torch.randn(num_seqs, NUM_HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5

    def torch_path():
        context = kv_chunks.index_select(0, chunk_ids + layer_offset).view(num_seqs, NUM_KV_HEADS, 2, ctx, HEAD_DIM)
        return decode_attention(q, context[:, :, 0], context[:, :, 1], bias, scale)

    def native_path():
        paged_decode_attention(q, kv_chunks, chunk_ids, layer_offset, lens, out, NUM_KV_HEADS, scale)
        return out

    def native_every_layer():   # as a step runs it: the pool is far larger than the caches, K/V come from DRAM
        for layer in range(NUM_LAYERS):
            paged_decode_attention(q, kv_chunks, chunk_ids, layer * NUM_KV_HEADS * 2, lens, out, NUM_KV_HEADS, scale)

    diff = (torch_path().float() - native_path().float()).abs().max().item()
    t_torch, t_native = best_time(torch_path, 0.5), best_time(native_path, 0.5)
    t_every = best_time(native_every_layer, 0.5) / NUM_LAYERS
    print(f"{num_seqs} decodes, contexts {int(lens.min())}-{int(lens.max())} (mean {lens.float().mean():.0f}), "
          f"one layer, {args.dtype}, max |difference| {diff:.1e}")
    print(f"  torch chunk gather + bmm  {t_torch * 1e6:8.1f} us")
    print(f"  native in-place kernel    {t_native * 1e6:8.1f} us")
    print(f"  native, {NUM_LAYERS} layers in turn  {t_every * 1e6:8.1f} us a layer (K/V from DRAM, as in a step)")
    suffix = "" if args.dtype == "float32" else "_bf16"   # the fp32 name predates --dtype
    print(f"RESULT paged_decode_native_speedup{suffix} {t_torch / t_native:.3f}")
    print(f"RESULT paged_decode_native_us_every_layer{suffix} {t_every * 1e6:.1f}")


if __name__ == "__main__":
    main()
