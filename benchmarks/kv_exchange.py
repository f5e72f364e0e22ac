"""What a parameter drop's KV exchange costs the steps that run beside it (KunServe §4.2), on the default model over
2 worker processes ([1,1] dropped into one 1x2 group).

    python benchmarks/kv_exchange.py [--running 8 --prompt-tokens 512 --queued 8 --steps 24 --runs 3
                                      --cpu-shares 0.25,0.5,1]

Each variant starts from [1,1] with --running requests decoding (their prompts prefilled, so their KV is what moves)
and --queued fresh requests waiting, then drops and steps the deployment --steps times, measuring every step.
Variants, alternating within each of --runs rounds on one deployment (restored to [1,1] between them):
  control          the running requests are aborted just before the drop: nothing moves, the queued requests run on
                   the pipeline alone (the steps without an exchange);
  overlapped@S     the KV moves on each worker's exchange thread beside the steps, held to S of a core while a step
                   runs (OverloadConfig.exchange_cpu_share and exchange_cpu_share_queued both S), the queued
                   requests run meanwhile;
  blocking         the whole KV moves inside the drop's transaction (exchange="blocking"): nothing steps meanwhile.
Reported: the drop call's time (the stop-the-world part), the exchange's wall time, the steps it spanned, the step
time overhead (the steps run while the exchange was in flight against the control's first as many steps, same
requests, same step mix), the queued requests' time to first token from the drop, and the running requests' stall
(last token before the drop to the next one). Medians over --runs with [min-max].

Then each variant restores [1,1] with every request still running and reports the restore reshape's time and the
requests' longest gap between two tokens across it over the steady step time before it (a request's TPOT across a
restore, in steps): the overlapped variants restore as the arbiter does (layers loaded and the running requests'
full KV blocks copied beside the steps first: restore_prewarm.py, restore_precopy.py), control and blocking as an
operator's blocking restore.

RESULT lines: kv_exchange_step_overhead (overlapped at the first share: step time during the exchange / control),
kv_exchange_queued_ttft_gain (blocking / overlapped), kv_exchange_running_stall_ratio (overlapped / blocking),
restore_gap_over_step_prewarm, restore_gap_over_step_blocking, restore_tpot_p99_over_steady_prewarm,
restore_tpot_p99_over_steady_blocking (P99 over the running requests of their TPOT across the restore over their
steady TPOT before it; see measure_restore)."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402
from regime import median_spread  # noqa: E402

STEADY_WINDOW = 16   # tokens before the restore a request's steady TPOT is taken over
TPOT_WINDOW = 32     # tokens from the restore's start its TPOT across the restore is taken over


def run_variant(dep, variant: str, running_prompts, queued_prompts, steps: int) -> dict:
    from elastic_hf.engine.sampling_params import SamplingParams

    overload = dep.overload
    share = float(variant.split("@")[1]) if variant.startswith("overlapped") else 1.0
    # the same cap with and without a queue: each variant measures one share
    overload.policy = dataclasses.replace(overload.policy, exchange_cpu_share=share, exchange_cpu_share_queued=share,
                                          exchange="blocking" if variant == "blocking" else "coordinated")
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True)   # never reached
    running = [dep.add_request(None, p, params) for p in running_prompts]
    last_token: dict[str, float] = {}
    while len(last_token) < len(running):   # every running request prefilled and decoding
        for out in dep.step():
            if out.outputs[0].token_ids:
                last_token[out.request_id] = time.perf_counter()
    dep.drain_batches()
    for out in dep.drained_outputs:
        last_token[out.request_id] = time.perf_counter()
    if variant == "control":
        for rid in running:
            dep.abort_request(rid)
        while any(i.engine.scheduler.running for i in dep.instances):
            dep.step()
        running = []
    queued = [dep.add_request(None, p, params) for p in queued_prompts]
    position = len(overload.history)
    t_drop = time.perf_counter()
    report = overload.drop()
    drop_s = time.perf_counter() - t_drop
    if report is None:
        raise RuntimeError(f"{variant}: the drop did not commit: {overload.history[-1]}")
    step_s, in_flight, first_token, resumed, seen = [], [], {}, {}, {}   # seen: request -> its token times
    # --steps steps, and on until every exchanged request has its next token (or 10x as many)
    while len(step_s) < steps or (len(resumed) < len(running) and len(step_s) < 10 * steps):
        exchanging = overload.exchange is not None
        t0 = time.perf_counter()
        outputs = dep.step()
        now = time.perf_counter()
        step_s.append(now - t0)
        in_flight.append(exchanging)
        for out in outputs:
            if out.request_id in queued and out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, now)
            elif out.request_id in last_token:
                resumed.setdefault(out.request_id, now)
            seen.setdefault(out.request_id, []).append(now)
    dep.settle_exchange()   # not finished within --steps: the rest before the restore is timed
    exchange = next((h for h in overload.history[position:] if h["event"] == "exchange_done"), None)
    restore = measure_restore(dep, seen, step_s[-8:], prewarm=variant.startswith("overlapped"))
    for rid in running + queued:
        dep.abort_request(rid)
    while dep.has_unfinished_requests():
        dep.step()
    return {**restore, "drop_s": drop_s, "step_s": step_s, "in_flight": in_flight,
            "exchange_wall_s": exchange["wall_seconds"] if exchange and running else 0.0,
            "exchange_work_s": exchange["seconds"] if exchange and running else 0.0,
            "sent_mib": exchange["sent_bytes"] / 2 ** 20 if exchange and running else 0.0,
            "queued_ttft_s": statistics.median(t - t_drop for t in first_token.values()) if first_token else None,
            "running_stall_s": statistics.median(resumed[r] - last_token[r] for r in running if r in resumed)
            if running and resumed else None}


def measure_restore(dep, seen: dict[str, list[float]], steady_steps: list[float], prewarm: bool) -> dict:
    """Restore [1,1] with every request still running and measure each request's longest gap between two tokens
    from the restore's start to its first token after the commit, against the steady step time just before, and
    its TPOT across the restore: the mean time per token over its first TPOT_WINDOW tokens from the restore's start
    (the prewarm, the KV pre-copy, the commit and the steps after it) over its TPOT on its last STEADY_WINDOW tokens
    before. prewarm: the arbiter's restore (layers loaded, then the running requests' full KV blocks copied beside
    the steps, then the reshape commits: restore_prewarm.py, restore_precopy.py); else the operator's blocking one
    (layers and all the KV inside one reshape)."""
    overload = dep.overload
    for _ in range(400):   # every request's steady TPOT on the pipeline first
        if all(len(ts) > STEADY_WINDOW for ts in seen.values()):
            break
        for out in dep.step():
            if out.request_id in seen:
                seen[out.request_id].append(time.perf_counter())
    t0 = time.perf_counter()
    if prewarm:
        if not overload.begin_restore():
            raise RuntimeError(f"the restore did not start: {overload.history[-1]}")
    elif overload.restore() is None:
        raise RuntimeError(f"the restore did not commit: {overload.history[-1]}")
    steady = {r: (ts[-1] - ts[-1 - STEADY_WINDOW]) / STEADY_WINDOW for r, ts in seen.items()
              if len(ts) > STEADY_WINDOW}
    last, gap, after = {r: ts[-1] for r, ts in seen.items()}, dict.fromkeys(seen, 0.0), set()
    start, since = dict(last), {r: [] for r in seen}
    for _ in range(600):
        committed = dep.topology == overload.base_topology
        for out in dep.step():
            now = time.perf_counter()
            if out.request_id in last:
                gap[out.request_id] = max(gap[out.request_id], now - last[out.request_id])
                last[out.request_id] = now
                since[out.request_id].append(now)
                if committed:
                    after.add(out.request_id)
        if len(after) >= len(seen) and all(len(since[r]) >= TPOT_WINDOW for r in steady):
            break
    restore_s = time.perf_counter() - t0
    entry = [h for h in overload.history if h["event"] == "restore"][-1]
    across = [(since[r][TPOT_WINDOW - 1] - start[r]) / TPOT_WINDOW / steady[r] for r in steady
              if len(since[r]) >= TPOT_WINDOW]
    return {"restore_s": entry["seconds"], "restore_total_s": restore_s,
            "restore_gap_s": statistics.median(gap.values()),
            "steady_step_s": statistics.median(steady_steps), "precopy_blocks": entry.get("precopy_blocks", 0),
            "tpot_p99_ratio": float(np.percentile(across, 99)) if across else float("nan")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=8, help="requests whose KV is exchanged")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="prompt length of the running requests")
    ap.add_argument("--queued", type=int, default=8, help="requests waiting at the drop (they run beside it)")
    ap.add_argument("--queued-prompt-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=24, help="steps measured after the drop")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cpu-shares", default="0.25,0.5,1", help="exchange_cpu_share values, comma-separated")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)   # the workers compute; this process schedules

    from elastic_hf import ElasticModel

    variants = ["control"] + [f"overlapped@{float(s):g}" for s in args.cpu_shares.split(",")] + ["blocking"]
    model = ElasticModel.from_pretrained(None, workers=2, dtype=args.dtype, enable_prefix_caching=False,
                                         kv_cache_memory=1 << 30)
    results: dict[str, list[dict]] = {v: [] for v in variants}
    try:
        dep = model.deployment
        tok = model.tokenizer
        running = wikitext_prompts(tok, args.running, args.prompt_tokens, args.prompt_tokens, seed=11)
        queued = wikitext_prompts(tok, args.queued, args.queued_prompt_tokens, args.queued_prompt_tokens, seed=12)
        model.generate([[1, 2, 3]] * 2, max_tokens=2)   # warm-up
        with tqdm(total=args.runs * len(variants), desc="kv exchange") as bar:
            for _ in range(args.runs):
                for variant in variants:
                    bar.set_description(f"kv exchange: {variant}")
                    results[variant].append(run_variant(dep, variant, running, queued, args.steps))
                    bar.update()
    finally:
        model.close()

    control = results["control"]

    def overhead(run: dict, ctrl: dict) -> float:
        """Mean step time while the exchange was in flight over the control's mean of as many first steps."""
        during = [s for s, exchanging in zip(run["step_s"], run["in_flight"]) if exchanging]
        base = ctrl["step_s"][:len(during)]
        return statistics.fmean(during) / statistics.fmean(base) if during else float("nan")

    print(f"machine: {machine_description()}; default model {args.dtype}, 2 worker processes, [1,1] -> 1x2 drop; "
          f"{args.running} running x {args.prompt_tokens} prompt tokens exchanged, {args.queued} queued x "
          f"{args.queued_prompt_tokens}; {args.steps} steps after the drop; medians of {args.runs} alternating "
          f"runs [min-max]")
    print(f"{'variant':<16}{'drop s':>22}{'exchange wall s':>24}{'steps spanned':>16}{'step overhead':>22}"
          f"{'queued TTFT s':>24}{'running stall s':>24}{'MiB sent':>10}{'restore reshape s':>22}{'gap/step':>20}"
          f"{'TPOT P99/steady':>20}{'pre-copied':>11}")
    summary: dict[str, dict] = {}
    for variant, runs in results.items():
        ratios = [overhead(r, c) for r, c in zip(runs, control)] if variant.startswith("overlapped") else []
        ttft = [r["queued_ttft_s"] for r in runs if r["queued_ttft_s"] is not None]
        stall = [r["running_stall_s"] for r in runs if r["running_stall_s"] is not None]
        summary[variant] = {"overhead": ratios, "ttft": ttft, "stall": stall}
        print(f"{variant:<16}{median_spread([r['drop_s'] for r in runs], 3):>22}"
              f"{median_spread([r['exchange_wall_s'] for r in runs], 3):>24}"
              f"{statistics.median(sum(r['in_flight']) for r in runs):>16g}"
              f"{median_spread(ratios, 3) if ratios else '-':>22}{median_spread(ttft, 3) if ttft else '-':>24}"
              f"{median_spread(stall, 3) if stall else '-':>24}{statistics.median(r['sent_mib'] for r in runs):>10.1f}"
              f"{median_spread([r['restore_s'] for r in runs], 3):>22}"
              f"{median_spread([r['restore_gap_s'] / r['steady_step_s'] for r in runs], 2):>20}"
              f"{median_spread([r['tpot_p99_ratio'] for r in runs], 3):>20}"
              f"{statistics.median(r['precopy_blocks'] for r in runs):>11g}")
    first = variants[1]
    blocking = summary["blocking"]
    print(f"RESULT kv_exchange_step_overhead {statistics.median(summary[first]['overhead']):.4g}")
    print(f"RESULT kv_exchange_queued_ttft_gain "
          f"{statistics.median(blocking['ttft']) / statistics.median(summary[first]['ttft']):.4g}")
    print(f"RESULT kv_exchange_running_stall_ratio "
          f"{statistics.median(summary[first]['stall']) / statistics.median(blocking['stall']):.4g}")
    for name, prewarm in (("prewarm", True), ("blocking", False)):
        gaps = [r["restore_gap_s"] / r["steady_step_s"] for v, runs in results.items() for r in runs
                if v.startswith("overlapped") == prewarm]
        print(f"RESULT restore_gap_over_step_{name} {statistics.median(gaps):.4g}")
        tpot = [r["tpot_p99_ratio"] for v, runs in results.items() for r in runs if v.startswith("overlapped") == prewarm]
        print(f"RESULT restore_tpot_p99_over_steady_{name} {statistics.median(tpot):.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
