"""Fixed [1,1], [2], [1x2] vs live switching on the replayed Azure code trace, 2 worker processes, one run.

Every variant serves the same requests (trace rows scaled to this machine: prompt tokens x0.25 capped at 384,
outputs capped at 48, arrivals rescaled to each request rate) in-process through the Deployment, open loop:
requests are added at their arrival times whatever is still running. "live" starts as [1,1] and reshapes to [1x2]
(each stage commits only its layers, so the pipeline holds far more KV) when the oldest queued request is blocked
on KV, and back to [1,1] once nothing queues and KV use is under 40 %. Also the decode step time vs batch size of each layout, which shows where two cores are
compute-bound.

    python benchmarks/pp_serving.py [--model PATH] [--num-requests 16] [--rates 0.5,1,2] [--kv-mib 24]

Prints TTFT / TPOT P50 / P99 and throughput (output tokens/s, and prompt + output tokens/s) per variant and rate,
`RESULT pp_live_vs_best_fixed_tput <live / best fixed total throughput at the highest rate>` and
`RESULT pp_vs_tp1_step_ms_b32 <1x2 / [1,1] decode step time at the largest batch>`.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402
from replay import TraceScale, build_requests, load_trace, percentile, scale_trace, time_scale_for_rate  # noqa: E402

from elastic_hf import ElasticModel  # noqa: E402
from elastic_hf.engine.sampling_params import SamplingParams  # noqa: E402

FIXED = ["[1,1]", "[2]", "[1x2]"]


def _live_switch(dep) -> None:
    schedulers = [i.engine.scheduler for i in dep.instances]
    used, total = sum(s.kv.num_used for s in schedulers), sum(s.kv.num_total for s in schedulers)
    queued = sum(len(s.waiting) for s in schedulers)
    blocked = any(s.head_of_line()[1] for s in schedulers)
    now = str(dep.topology)
    if now == "[1,1]" and blocked:
        dep.reshape(["1x2"])
    elif now == "[1x2]" and queued == 0 and used < 0.4 * total:
        try:
            dep.reshape([1, 1])
        except ValueError:   # the running requests do not fit the split layout yet
            pass


def replay(dep, requests, live: bool) -> dict:
    start = time.perf_counter()
    arrival, first, last, count, prompt_tokens = {}, {}, {}, {}, 0
    pending = list(requests)
    reshapes_before = len(dep.reshapes)
    while pending or dep.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0].arrival_s <= now:
            req = pending.pop(0)
            rid = dep.add_request(None, req.prompt, SamplingParams(temperature=0.0, max_tokens=req.max_tokens,
                                                                    ignore_eos=True))
            arrival[rid] = req.arrival_s
            prompt_tokens += req.prompt_tokens
        if live:
            _live_switch(dep)
        outs = dep.step()
        now = time.perf_counter() - start
        for out in outs:
            first.setdefault(out.request_id, now)
            last[out.request_id] = now
            count[out.request_id] = len(out.outputs[0].token_ids)
        if not outs and pending and not dep.has_unfinished_requests():
            time.sleep(max(0.0, min(0.01, pending[0].arrival_s - now)))
    makespan = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in arrival]
    tpot = [(last[r] - first[r]) / (count[r] - 1) for r in arrival if count[r] > 1]
    return {"ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99), "tpot_p50": percentile(tpot, 50),
            "tpot_p99": percentile(tpot, 99), "throughput": sum(count.values()) / makespan,
            "total_throughput": (sum(count.values()) + prompt_tokens) / makespan,
            "reshapes": sum(r.committed for r in dep.reshapes[reshapes_before:])}


def step_times(dep, tokenizer, batches: list[int], steps: int = 6) -> dict[int, float]:
    """Decode step time (ms) with `b` sequences in the deployment, after their prefill."""
    out = {}
    for b in batches:
        prompts = wikitext_prompts(tokenizer, b, 32, 32, seed=b)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for p in prompts:
            dep.add_request(None, p, params)
        for _ in range(3):   # prefill (and one decode)
            dep.step()
        t0 = time.perf_counter()
        for _ in range(steps):
            dep.step()
        out[b] = (time.perf_counter() - t0) / steps * 1e3
        while dep.has_unfinished_requests():
            dep.step()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--rates", default="0.5,1,2", help="request rates (req/s), comma-separated")
    parser.add_argument("--max-prompt", type=int, default=384)
    parser.add_argument("--max-output", type=int, default=48)
    parser.add_argument("--kv-mib", type=int, default=24, help="KV MiB per worker as a TP1 instance")
    parser.add_argument("--batches", default="1,4,16,32", help="batch sizes of the step-time table")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]

    model = ElasticModel.from_pretrained(args.model, workers=2, kv_cache_memory=args.kv_mib << 20,
                                         max_num_batched_tokens=256)
    dep = model.deployment
    rows = scale_trace(load_trace(num_requests=args.num_requests),
                       TraceScale(1.0, 0.25, 1.0, args.max_prompt, args.max_output))
    results: dict[tuple[str, float], dict] = {}
    steps: dict[str, dict[int, float]] = {}
    try:
        with tqdm(total=len(FIXED) * 2 + len(rates) * (len(FIXED) + 1), desc="pp serving") as progress:
            for topology in FIXED:
                dep.reshape(topology)
                model.generate([[1, 2, 3]] * 2, max_tokens=2)   # warm-up
                steps[topology] = step_times(dep, dep.tokenizer, [int(b) for b in args.batches.split(",")])
                progress.update(2)
            for rate in rates:
                scale = time_scale_for_rate(rows, rate)
                timed = [dataclasses.replace(r, arrival_s=r.arrival_s * scale) for r in rows]
                requests = build_requests(timed, dep.tokenizer, seed=0)
                for variant in FIXED + ["live"]:
                    dep.reshape("[1,1]" if variant == "live" else variant)
                    results[(variant, rate)] = replay(dep, requests, live=variant == "live")
                    progress.update()
    finally:
        model.close()

    print(f"machine: {machine_description()}; model {dep.model_id}; 2 worker processes (gloo), {args.kv_mib} MiB "
          f"KV per worker as TP1; {args.num_requests} trace requests, prompts <= {args.max_prompt}, outputs <= "
          f"{args.max_output} tokens")
    print("decode step time (ms) by batch size:")
    for topology, table in steps.items():
        print(f"  {topology:<6} " + "  ".join(f"b={b}: {ms:6.1f}" for b, ms in table.items()))
    print(f"{'variant':<8}{'rate':>6}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}"
          f"{'out tok/s':>10}{'all tok/s':>10}{'reshapes':>10}")
    for (variant, rate), r in results.items():
        print(f"{variant:<8}{rate:>6.2f}{r['ttft_p50']:>10.3f}{r['ttft_p99']:>10.3f}{r['tpot_p50']:>10.3f}"
              f"{r['tpot_p99']:>10.3f}{r['throughput']:>10.1f}{r['total_throughput']:>10.1f}{r['reshapes']:>10}")
    top = max(rates)
    best_fixed = max(results[(t, top)]["total_throughput"] for t in FIXED)
    print(f"RESULT pp_live_vs_best_fixed_tput {results[('live', top)]['total_throughput'] / best_fixed:.3f}")
    print(f"RESULT pp_vs_tp1_step_ms_b32 {steps['[1x2]'][max(steps['[1x2]'])] / steps['[1,1]'][max(steps['[1,1]'])]:.3f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
