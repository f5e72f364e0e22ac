"""On a GPU: elastic-hf with CUDA graphs for decode steps, the same engine with --enforce-eager, and HF static-batch
generate (SDPA), same model, same prompts, greedy, in one run.

    python benchmarks/cuda_graphs.py [--dtype {bfloat16,float32}] [--num-requests 32] [--max-new-tokens 64]
                                     [--long-context 4000] [--repeats 3] [--shape llama-3.2-1b] [--profile]

The model has the default model's architecture (SmolLM2-135M: 30 layers, hidden 576, 9 query / 3 KV heads) with
random weights and a minimal tokenizer, so the benchmark runs on a GPU machine that has no default model; prompts are
random token ids and every request makes exactly --max-new-tokens (ignore_eos), so the weights' values do not change
the work. Three workloads: a batch of --num-requests prompts of 32-96 tokens (throughput), one stream of 128 tokens
(batch-1 decode) and one stream after a --long-context-token prompt (time per output token over a long context,
prefill excluded). Engines are loaded once and timed round-robin, --repeats times; the ratios compare medians.
Prints `RESULT cuda_graphs_speedup_b32`, `RESULT cuda_graphs_speedup_b1`, `RESULT cuda_vs_hf_static_b32`,
`RESULT cuda_vs_hf_static_b1`, `RESULT cuda_long_context_tpot_vs_hf` (> 1: elastic-hf faster), for the stacked q/k/v
and gate/up GEMMs (against packed_weights="off") `RESULT cuda_stacked_linears_speedup_b32` / `_b1`, and for the fused
decoder-layer forward (fused_layers="on") on eager steps `RESULT cuda_fused_layers_eager_speedup_b1`,
`RESULT cuda_fused_layers_prefill_speedup`."""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from common import machine_description  # noqa: E402
from model_shapes import SHAPES, random_checkpoint  # noqa: E402

# prompts are ids below the default model's vocabulary: valid in every shape's
PROMPT_VOCAB = SHAPES["smollm2-135m"]["vocab_size"]


def random_prompts(num: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)   # the same prompts for every shape
    return [torch.randint(3, PROMPT_VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(num)]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


class Elastic:
    def __init__(self, checkpoint, dtype, max_seqs, enforce_eager, fused_layers="auto", packed_weights="auto"):
        from elastic_hf import ElasticModel

        self.label = "elastic-hf, " + ("--enforce-eager" if enforce_eager else "CUDA graphs") + (
            ", fused layers" if fused_layers == "on" else "") + (", unstacked" if packed_weights == "off" else "")
        self.model = ElasticModel.from_pretrained(str(checkpoint), device="cuda", dtype=dtype, max_num_seqs=max_seqs,
                                                  kv_cache_memory=4 << 30, max_num_batched_tokens=8192,
                                                  enforce_eager=enforce_eager, fused_layers=fused_layers,
                                                  packed_weights=packed_weights)

    def generate(self, prompts, max_new):
        self.model.generate(prompts, max_tokens=max_new, ignore_eos=True)


class HfStatic:
    label = "HF static generate (sdpa)"

    def __init__(self, checkpoint, dtype, max_seqs, enforce_eager):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=dtype,
                                                          attn_implementation="sdpa").cuda().eval()

    @torch.inference_mode()
    def generate(self, prompts, max_new):
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[2] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
        self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                            do_sample=False, eos_token_id=None, pad_token_id=2)


def kernels_per_decode_step(engine, prompt, steps: int = 16) -> tuple[float, list[tuple[str, int]]]:
    """CUDA kernels one batch-1 decode step launches (a generate of `steps` tokens less one of 1 token, over
    torch.profiler), and the most frequent kernel names of the decode steps."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    def count(new):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate([prompt], new)
            torch.cuda.synchronize()
        return Counter(e.name for e in prof.events() if e.device_type.name == "CUDA")

    many, one = count(steps + 1), count(1)
    decode = many - one
    return sum(decode.values()) / steps, [(name, n // steps) for name, n in decode.most_common(12)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--long-context", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES),
                        help="the architecture's shapes, random weights (benchmarks/model_shapes.py)")
    parser.add_argument("--profile", action="store_true",
                        help="also count the CUDA kernels of a batch-1 decode step (eager and graphed)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/cuda_graphs.py needs a CUDA device")
    print(f"machine: {machine_description()}; GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(f"model: {args.shape} architecture, random weights, {args.dtype}")
    batch = random_prompts(args.num_requests, 32, 96, seed=0)
    single = random_prompts(1, 64, 64, seed=1)
    long = random_prompts(1, args.long_context, args.long_context, seed=2)
    workloads = {   # name -> (prompts, new tokens, tokens counted)
        "b32": (batch, args.max_new_tokens),
        "b1": (single, 128),
        "long": (long, 64),
    }
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = random_checkpoint(args.shape, Path(tmp) / args.shape)
        engines = {"graphs": Elastic(checkpoint, args.dtype, args.num_requests, False),
                   "graphs_unstacked": Elastic(checkpoint, args.dtype, args.num_requests, False, packed_weights="off"),
                   "eager": Elastic(checkpoint, args.dtype, args.num_requests, True),
                   "eager_fused": Elastic(checkpoint, args.dtype, args.num_requests, True, "on"),
                   "hf": HfStatic(checkpoint, args.dtype, args.num_requests, False)}
        # warm-up: captures, Triton compiles, cuBLAS heuristics. Two passes: on an H100 the first engine's first b32
        # generate after the others had warmed up took 4.3 s instead of 0.3 (once, no graph captured in it; cause
        # not established), which at --repeats 2 was half of the median (docs/GPU.md, 2026-11-27 second session)
        for _ in range(2):
            for engine in engines.values():
                for prompts, new in workloads.values():
                    engine.generate(prompts, new)
        samples = {(e, w): [] for e in engines for w in workloads}
        prefill_only = {e: [] for e in engines}
        for _ in tqdm(range(args.repeats), desc="rounds"):
            for name, engine in engines.items():
                for w, (prompts, new) in workloads.items():
                    samples[name, w].append(timed(lambda: engine.generate(prompts, new)))
                prefill_only[name].append(timed(lambda: engine.generate(long, 1)))
        kv = engines["graphs"].model.memory_report()
        print(f"KV cache of 4 GiB: {kv['kv_blocks']} blocks of {kv['kv_block_bytes']} bytes "
              f"({kv['kv_blocks'] * 16} tokens)")
        if args.profile:
            for name in ("eager", "graphs_unstacked", "graphs"):
                per_step, top = kernels_per_decode_step(engines[name], single[0])
                print(f"{engines[name].label}: {per_step:.0f} CUDA kernels per batch-1 decode step; most frequent:")
                for kernel, n in top:
                    print(f"  {n:5d}  {kernel[:110]}")
    med = {k: statistics.median(v) for k, v in samples.items()}
    rate = {(e, w): len(workloads[w][0]) * workloads[w][1] / med[e, w] for e, w in med}
    # time per output token over the long context: (64 tokens - the prefill's first one) / 63
    tpot = {e: (med[e, "long"] - statistics.median(prefill_only[e])) / 63 for e in engines}
    print(f"\n{'engine':32s} {'b' + str(args.num_requests) + ' tok/s':>12s} {'b1 tok/s':>10s} "
          f"{'TPOT @' + str(args.long_context) + ' ms':>14s}")
    for e, engine in engines.items():
        print(f"{engine.label:32s} {rate[e, 'b32']:12.1f} {rate[e, 'b1']:10.1f} {tpot[e] * 1e3:14.2f}")
    print(f"RESULT cuda_graphs_speedup_b32 {rate['graphs', 'b32'] / rate['eager', 'b32']:.3f}")
    print(f"RESULT cuda_graphs_speedup_b1 {rate['graphs', 'b1'] / rate['eager', 'b1']:.3f}")
    print(f"RESULT cuda_vs_hf_static_b32 {rate['graphs', 'b32'] / rate['hf', 'b32']:.3f}")
    print(f"RESULT cuda_vs_hf_static_b1 {rate['graphs', 'b1'] / rate['hf', 'b1']:.3f}")
    print(f"RESULT cuda_long_context_tpot_vs_hf {tpot['hf'] / tpot['graphs']:.3f}")
    # q/k/v and gate/up as one GEMM each over their stacked weights (layers/stacked_linear.py), in graphs
    for w in ("b32", "b1"):
        print(f"RESULT cuda_stacked_linears_speedup_{w} {rate['graphs', w] / rate['graphs_unstacked', w]:.3f}")
    # the fused decoder-layer forward on eager steps (prefills, mixed steps): > 1, it is faster than HF's
    print(f"RESULT cuda_fused_layers_eager_speedup_b1 {rate['eager_fused', 'b1'] / rate['eager', 'b1']:.3f}")
    print(f"RESULT cuda_fused_layers_prefill_speedup "
          f"{statistics.median(prefill_only['eager']) / statistics.median(prefill_only['eager_fused']):.3f}")


if __name__ == "__main__":
    main()
