"""Transformation-aware routing vs baselines on a mixed trace (Gyges §6.2.4 scaled to this machine): short requests
arrive at a steady rate, a few long ones (longer than one TP1 worker's KV cache) now and then.

Variants, all on the same worker processes and the same trace, one after the other:
- elastic: Gyges Alg. 1-2 (capacity-aware routing, long requests reuse merged instances, split back below 50 %),
- round_robin / least_load + elastic scale-up around the instance they picked (the paper's RR / LLF),
- static TP-N layouts that can serve the long requests ([2,2] and [2,1,1] on 4 workers, [2] on 2).

    python benchmarks/tp_routing.py [--model PATH] [--workers 4] [--duration 20]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402

from elastic_hf import ElasticModel  # noqa: E402
from elastic_hf.config import EngineConfig  # noqa: E402
from elastic_hf.engine.routing import TPPolicy  # noqa: E402
from elastic_hf.engine.sampling_params import SamplingParams  # noqa: E402
from elastic_hf.parallel.deployment import Deployment  # noqa: E402


def make_trace(tokenizer, duration: float, short_every: float, long_at: list[float], long_len: int, seed: int = 0):
    num_short = int(duration / short_every)
    shorts = wikitext_prompts(tokenizer, num_short, 24, 96, seed=seed)
    longs = wikitext_prompts(tokenizer, len(long_at), long_len, long_len, seed=seed + 1)
    trace = [(i * short_every, p, False) for i, p in enumerate(shorts)]
    trace += [(t, p, True) for t, p in zip(long_at, longs)]
    return sorted(trace, key=lambda x: x[0])


def replay(dep: Deployment, trace, max_new: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    start = time.perf_counter()
    arrival, first_token, finish = {}, {}, {}
    pending = list(trace)
    num_reshapes = len(dep.reshapes)
    tokens = 0
    while pending or dep.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            t, prompt, _ = pending.pop(0)
            rid = dep.add_request(None, prompt, params)
            arrival[rid] = t
        outs = dep.step()
        now = time.perf_counter() - start
        for out in outs:
            first_token.setdefault(out.request_id, now)
            if out.finished:
                finish[out.request_id] = now
                tokens += len(out.outputs[0].token_ids)
        if not outs and pending and not dep.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[0][0] - now)))
    makespan = time.perf_counter() - start
    ttft = [first_token[r] - arrival[r] for r in arrival]
    e2e = [finish[r] - arrival[r] for r in arrival]
    reshapes = dep.reshapes[num_reshapes:]
    return {"throughput": tokens / makespan, "makespan": makespan, "ttft_mean": statistics.mean(ttft),
            "e2e_p50": statistics.median(e2e), "num_reshapes": sum(r.committed for r in reshapes),
            "reshape_s": sum(r.seconds for r in reshapes if r.committed)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of short-request arrivals")
    parser.add_argument("--short-every", type=float, default=0.25)
    parser.add_argument("--long-len", type=int, default=640, help="tokens of a long prompt")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--kv-mib", type=int, default=16, help="KV MiB per worker as TP1: sets what is long")
    args = parser.parse_args()

    model = ElasticModel.from_pretrained(args.model, workers=args.workers, kv_cache_memory=args.kv_mib << 20,
                                         max_num_batched_tokens=256)
    dep = model.deployment
    long_at = [args.duration * f for f in (0.15, 0.5, 0.6)]
    trace = make_trace(dep.tokenizer, args.duration, args.short_every, long_at, args.long_len)
    n = args.workers
    statics = [(2,) * (n // 2), (2,) + (1,) * (n - 2)] if n >= 4 else [(2,)]
    variants = [("elastic", "elastic", (1,) * n), ("round_robin", "elastic", (1,) * n),
                ("least_load", "elastic", (1,) * n)]
    variants += [(f"static {list(s)}", "static", s) for s in dict.fromkeys(statics)]
    results = {}
    try:
        for name, tp_policy, start_topology in variants:
            dep.reshape(start_topology)
            router = name if tp_policy == "elastic" else "elastic"  # static: capacity-aware routing
            dep.policy = TPPolicy(EngineConfig(tp_policy=tp_policy, router=router), dep.degrees)
            model.generate(trace[0][1:2] * len(dep.instances), max_tokens=2)  # warm-up every instance
            results[name] = replay(dep, trace, args.max_new_tokens)
            r = results[name]
            print(f"{name:>20}: {r['throughput']:6.1f} tok/s, makespan {r['makespan']:5.1f} s, TTFT mean "
                  f"{r['ttft_mean']:5.2f} s, e2e p50 {r['e2e_p50']:5.2f} s, {r['num_reshapes']} reshapes "
                  f"({r['reshape_s'] * 1e3:.0f} ms)", flush=True)
    finally:
        model.close()
    num_long = len(long_at)
    print(f"machine: {machine_description()}; model {dep.model_id}; {n} worker processes; trace: "
          f"{len(trace) - num_long} short (24-96 tokens, every {args.short_every} s) + {num_long} long "
          f"({args.long_len} tokens > one TP1 worker's {dep.tp1_blocks * dep.config.block_size} KV tokens), "
          f"{args.max_new_tokens} new tokens each")
    best_static = max(v["throughput"] for k, v in results.items() if k.startswith("static"))
    best_baseline = max(results["round_robin"]["throughput"], results["least_load"]["throughput"])
    print(f"elastic vs best router baseline: {results['elastic']['throughput'] / best_baseline:.2f}x")
    print(f"RESULT elastic_vs_best_static {results['elastic']['throughput'] / best_static:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
