"""Cross-step pipelining vs a pipeline drained at every step, on a 1x2 instance of the default model (2 worker
processes), with data parallelism [1,1] on the same two workers as the reference.

    python benchmarks/pipeline_bubble.py [--requests 16 --prompt-tokens 64 --max-tokens 48 --runs 3]

Each run serves the same closed batch of requests (all added at once, decoded to --max-tokens) three ways,
alternating: `cross-step` (two batches in flight, engine/batch_queue.py: stage 0 runs batch t+1 while stage 1
finishes t), `drained` (pipeline_batches=1: each step's micro-batches, one per stage by token counts, and the pipe
drains before the next step) and `dp` ([1,1], no pipeline). Reports output tokens/s, decode TPOT, and the bubble
ratio: 1 - busy / (wall + the idle gap before each step shorter than 0.5 s), summed over both stages (the
elastic_hf_pipeline_bubble_ratio gauge's definition). Medians over --runs with [min-max].

RESULT lines: pipeline_bubble_cross_step, pipeline_bubble_drained, cross_step_vs_drained_throughput,
cross_step_vs_dp_throughput."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402
from regime import median_spread  # noqa: E402

VARIANTS = ("cross-step", "drained", "dp")


def serve_batch(dep, prompts, max_tokens: int) -> dict:
    from elastic_hf.engine.sampling_params import SamplingParams

    metrics = dep.deployment_metrics
    busy0, wall0 = metrics.pipeline_busy_s, metrics.pipeline_wall_s
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    ids = [dep.add_request(None, p, params) for p in prompts]
    first, last, count = {}, {}, {}
    while len(last) < len(ids) or dep.has_unfinished_requests():
        for out in dep.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            count[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                last[out.request_id] = now
    wall = time.perf_counter() - started
    busy, span = metrics.pipeline_busy_s - busy0, metrics.pipeline_wall_s - wall0
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in ids if count[r] > 1]
    return {"tok_s": sum(count.values()) / wall, "tpot": statistics.median(tpot),
            "bubble": 1 - busy / span if span > 0 else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--topology", default="1x2", help="the pipelined layout, e.g. 1x2:19/11 (the LM head weighs "
                                                      "~8 of SmolLM2's layers)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)   # the workers compute; this process schedules

    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(None, workers=2, topology=args.topology, dtype=args.dtype,
                                         kv_cache_memory=64 << 20, enable_prefix_caching=False)
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    try:
        dep = model.deployment
        prompts = wikitext_prompts(model.tokenizer, args.requests, args.prompt_tokens, args.prompt_tokens, seed=5)
        model.generate([[1, 2, 3]] * 2, max_tokens=2)   # warm-up
        with tqdm(total=args.runs * len(VARIANTS), desc="pipeline bubble") as bar:
            for _ in range(args.runs):
                for variant in VARIANTS:
                    target = [1, 1] if variant == "dp" else [args.topology]
                    if dep.topology != dep.check_topology(target):
                        dep.reshape(target)
                    for inst in dep.instances:   # the runner reads it per step; the queue is empty here
                        inst.runner.pipeline_batches = 1 if variant == "drained" else None
                    results[variant].append(serve_batch(dep, prompts, args.max_tokens))
                    bar.update()
    finally:
        model.close()

    print(f"machine: {machine_description()}; default model {args.dtype}, 2 worker processes, {args.topology}; "
          f"{args.requests} "
          f"requests x {args.prompt_tokens} prompt tokens, {args.max_tokens} outputs each, all at once; medians of "
          f"{args.runs} alternating runs [min-max]")
    print(f"{'variant':<12}{'output tok/s':>26}{'TPOT p50 (s)':>28}{'bubble':>26}")
    for variant, runs in results.items():
        bubble = median_spread([r["bubble"] for r in runs]) if variant != "dp" else "-"
        print(f"{variant:<12}{median_spread([r['tok_s'] for r in runs], 1):>26}"
              f"{median_spread([r['tpot'] for r in runs], 4):>28}{bubble:>26}")

    def ratio(a, b):
        return statistics.median(x["tok_s"] / y["tok_s"] for x, y in zip(results[a], results[b]))

    print(f"RESULT pipeline_bubble_cross_step {statistics.median(r['bubble'] for r in results['cross-step']):.4g}")
    print(f"RESULT pipeline_bubble_drained {statistics.median(r['bubble'] for r in results['drained']):.4g}")
    print(f"RESULT cross_step_vs_drained_throughput {ratio('cross-step', 'drained'):.4g}")
    print(f"RESULT cross_step_vs_dp_throughput {ratio('cross-step', 'dp'):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
