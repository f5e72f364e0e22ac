"""Where a served request's time to first token goes under load: replay a trace against `elastic-hf serve
--timeline`, join the server's per-request and per-step records (elastic_hf/engine/timeline.py) with the client's
view, and split every request's TTFT into

    front end in   client send -> engine arrival stamp (HTTP and request parsing, up to AsyncEngine.add_requests)
    queue          engine arrival -> first admission (tokenization on the input thread, the hop to the engine
                   thread, then waiting for the step budget, a sequence slot or KV blocks)
    prefill        admission -> first token (its chunks, and the steps of other requests between them)
    front end out  engine first token -> client sees it (detokenization, SSE, the event loop)

for the median and the tail (requests at or above the TTFT P95), beside what the steps packed meanwhile (prefill
tokens and decodes per step, step time, how many requests waited).

    python benchmarks/serving_timeline.py [--rate 4 --num-requests 96] [--serve-args "--max-num-batched-tokens 1024"]
                                          [--plot timeline.png]

Prints a table and `RESULT timeline_<phase>_<p50|tail>_s` lines, plus the step mix."""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from replay import (ServerProcess, TraceScale, build_requests, load_trace, percentile, prompt_scale_for,  # noqa: E402
                    run_replay, scale_trace, time_scale_for_rate, _load_tokenizer)
from common import machine_description  # noqa: E402

PHASES = ("front_in", "queue", "prefill", "front_out")


def request_phases(report, server_requests: dict[str, dict]) -> list[dict]:
    """One row per request both sides saw: its TTFT split into PHASES (seconds), and its sizes."""
    rows = []
    for r in report.ok:
        s = server_requests.get(r.response_id)
        if s is None or s["scheduled"] is None or s["first_token"] is None:
            continue
        rows.append({"ttft": r.ttft_s, "front_in": s["arrival"] - r.sent_at, "queue": s["scheduled"] - s["arrival"],
                     "prefill": s["first_token"] - s["scheduled"], "front_out": r.first_token_at - s["first_token"],
                     "prompt_tokens": s["prompt_tokens"], "chunks": s["chunks"], "preemptions": s["preemptions"],
                     "sent_at": r.sent_at, "arrival": s["arrival"], "scheduled": s["scheduled"],
                     "first_token": s["first_token"]})
    return rows


def step_mix(steps: list[dict]) -> dict[str, float]:
    """Medians of what the steps packed, and the share of busy time spent in steps with prefill."""
    if not steps:
        return {}
    times = [s["end"] - s["start"] for s in steps]
    with_prefill = [t for s, t in zip(steps, times) if s["prefill_tokens"]]
    return {"steps": len(steps), "step_s_p50": statistics.median(times),
            "prefill_tokens_p50": statistics.median(s["prefill_tokens"] for s in steps),
            "decodes_p50": statistics.median(s["decode_seqs"] for s in steps),
            "waiting_max": max(s["waiting"] for s in steps), "running_max": max(s["running"] for s in steps),
            "prefill_step_share": sum(with_prefill) / sum(times),
            "busy_s": sum(times), "span_s": steps[-1]["end"] - steps[0]["start"],
            "preemptions": steps[-1]["preemptions"]}


def print_table(rows: list[dict]) -> dict[str, dict[str, float]]:
    cutoff = percentile([r["ttft"] for r in rows], 95)
    tail = [r for r in rows if r["ttft"] >= cutoff]
    out = {"p50": {p: statistics.median(r[p] for r in rows) for p in ("ttft", *PHASES)},
           "tail": {p: statistics.mean(r[p] for r in tail) for p in ("ttft", *PHASES)}}
    print(f"\nTTFT split ({len(rows)} requests; tail: the {len(tail)} at or above P95 = {cutoff:.3f} s, mean)")
    print("| | TTFT s | front end in | queue | prefill | front end out |\n|---|---|---|---|---|---|")
    for key, label in (("p50", "median"), ("tail", "tail")):
        v = out[key]
        print(f"| {label} | {v['ttft']:.3f} | " + " | ".join(f"{v[p]:.3f}" for p in PHASES) + " |")
    print(f"tail requests: prompt tokens {[r['prompt_tokens'] for r in tail]}, chunks {[r['chunks'] for r in tail]}, "
          f"preemptions {sum(r['preemptions'] for r in tail)}")
    return out


def plot(rows: list[dict], steps: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = min(r["sent_at"] for r in rows)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    for i, r in enumerate(sorted(rows, key=lambda r: r["sent_at"])):
        top.plot([r["sent_at"] - t0, r["scheduled"] - t0], [i, i], color="tab:red", lw=2)
        top.plot([r["scheduled"] - t0, r["first_token"] - t0], [i, i], color="tab:blue", lw=2)
    top.set_ylabel("request (by arrival)")
    top.set_title("red: waiting for admission, blue: admission to first token")
    bottom.step([s["start"] - t0 for s in steps], [s["prefill_tokens"] for s in steps], where="post",
                label="prefill tokens / step")
    bottom.step([s["start"] - t0 for s in steps], [s["waiting"] for s in steps], where="post", label="waiting")
    bottom.set_xlabel("seconds since the first request")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model to serve (default: the default model)")
    ap.add_argument("--serve-args", default="", help="extra flags for elastic-hf serve, one string")
    ap.add_argument("--num-requests", type=int, default=96)
    ap.add_argument("--rate", type=float, default=4.0, help="mean arrival rate, req/s")
    ap.add_argument("--trace", default="code", choices=("code", "conv"), help="the trace replayed")
    ap.add_argument("--prompt-scale", type=float, default=None, help="default: 1/16 for code, 1/4 for conv")
    ap.add_argument("--max-prompt-tokens", type=int, default=512)
    ap.add_argument("--max-output-tokens", type=int, default=64)
    ap.add_argument("--plot", default=None, help="write a PNG of every request's wait and prefill over time")
    ap.add_argument("--keep", default=None, metavar="PATH", help="keep the server's timeline file here")
    args = ap.parse_args()

    from elastic_hf.model.loader import resolve_model
    checkpoint = str(resolve_model(args.model).checkpoint_dir)
    rows = load_trace(args.trace, start=0, num_requests=args.num_requests)
    scale = TraceScale(time_scale_for_rate(rows, args.rate), prompt_scale_for(args.trace, args.prompt_scale), 1.0,
                       args.max_prompt_tokens, args.max_output_tokens)
    requests = build_requests(scale_trace(rows, scale), _load_tokenizer(checkpoint))
    print(f"machine: {machine_description()}\n{len(requests)} requests of the Azure {args.trace} trace at "
          f"{args.rate} req/s, {scale.describe()}")
    with tempfile.TemporaryDirectory() as tmp:
        timeline = Path(args.keep) if args.keep else Path(tmp) / "timeline.jsonl"
        timeline.unlink(missing_ok=True)
        server = ServerProcess([checkpoint, "--timeline", str(timeline), *shlex.split(args.serve_args)])
        try:
            report = run_replay(server.base_url, requests, progress=False)
        finally:
            server.stop()
        from elastic_hf.engine.timeline import read_timeline
        steps, server_requests = read_timeline(timeline)
    print(report.summary())
    joined = request_phases(report, server_requests)
    if len(joined) < len(report.ok):
        print(f"warning: {len(report.ok) - len(joined)} requests missing from the server's timeline")
    if not joined:
        print("no request of the replay is in the server's timeline: nothing to split")
        return 1
    split = print_table(joined)
    mix = step_mix(steps)
    print("steps: " + ", ".join(f"{k} {v:.3g}" for k, v in mix.items()))
    for key in ("p50", "tail"):
        for phase in PHASES:
            print(f"RESULT timeline_{phase}_{key}_s {split[key][phase]:.4g}")
    if args.plot:
        plot(joined, steps, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
