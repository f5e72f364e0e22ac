"""Precision morphing under a replayed trace: static full precision vs static W4 (all layers) vs morphing
(default mode), side by side in one run, under the same memory budget (MorphServe §5).

The three servers run one after another in this process (uvicorn in a thread, like the serving tests) over the
default model. The memory regime is the papers' (benchmarks/regime.py): the fp instance's KV cache is sized so that
its weights are `--weight-share` of weights + KV (default 0.5, then 0.3), not a few blocks beside them. In that
regime a 2-core CPU saturates its compute (prefill at ~2 ms a token) long before the trace's requests fill the KV
cache, so the fp server rarely waits for KV blocks (the table's "KV wait") and morphing has little to trade; the
old regime, where the fp cache held about one request and every gain was KV (weights ~97 % of memory), is
`--kv-blocks 16`. Each server replays `--runs` times, alternating, and the gain is the median with its spread.
Quality is the held-out wikitext perplexity as a function of how many layers run in W4 (in the swap order),
weighted by the tokens each server generated at each layer count: static fp loses nothing, static W4 loses
ppl(all) - ppl(0); `morph_quality_kept` = 1 - (morph's token-weighted loss) / (static W4's loss) and
`morph_quality_vs_static_w4` = ppl(static W4) / (morph's token-weighted perplexity).

    python benchmarks/morph_replay.py [--weight-share 0.5,0.3 | --kv-blocks 16] [--runs 3 --num-requests 48
                                      --rate 1.5 --plot out/benchmarks/morph_replay.png]
    python benchmarks/morph_replay.py --trace conv --max-output-tokens 512 --rate 2   # decode-heavy

Prints per regime a table and `RESULT morph_p95_ttft_gain_ws50`, `..._min/_max`, `morph_fp_kv_wait_share_ws50`,
`morph_quality_kept_ws50`, `morph_quality_vs_static_w4_ws50`, `static_w4_p95_ttft_gain_ws50` (ws30 likewise)."""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import InProcessServer, machine_description, result_path  # noqa: E402
from regime import (add_weight_share_arg, kv_bytes_for_share, measured_weights_bytes, median_spread,  # noqa: E402
                    parse_weight_shares, share_label)
from replay import (TraceScale, build_requests, load_trace, run_replay, scale_trace, time_scale_for_rate,  # noqa: E402
                    trace_path)


class Recorder:
    """A step-boundary hook: (time, generated tokens so far, layers in W4, KV blocks, head of the queue blocked on
    KV blocks) at every step boundary."""

    def __init__(self, model):
        self.model = model
        self.rows: list[tuple[float, float, int, int, bool]] = []
        model.instances[0].engine.step_boundary_hooks.append(self)

    def __call__(self, engine):
        morph = self.model.morph
        num_w4 = morph.manager().counts()["w4"] if morph is not None else 0
        tokens = engine.metrics.generation_tokens._value.get()
        _, blocked = engine.scheduler.head_of_line()
        self.rows.append((time.time(), tokens, num_w4, engine.scheduler.kv.num_total, blocked))

    def tokens_by_w4_layers(self) -> dict[int, float]:
        """Tokens generated while k layers ran in W4 (a step's tokens count at the state before the step)."""
        out: dict[int, float] = {}
        for (_, tokens, k, _, _), (_, next_tokens, _, _, _) in zip(self.rows, self.rows[1:]):
            out[k] = out.get(k, 0.0) + (next_tokens - tokens)
        return out

    def kv_wait_share(self, duration_s: float) -> float:
        """Share of the replay's wall time during which the oldest queued request could not get its KV blocks
        (a step's interval counts as waiting when its boundary saw the head blocked): near 1 means the server is
        KV-bound, the regime MorphServe targets; near 0 means it is compute-bound or idle."""
        waited = sum(b[0] - a[0] for a, b in zip(self.rows, self.rows[1:]) if a[4])
        return min(1.0, waited / duration_s) if duration_s > 0 else 0.0


def load_model(kind: str, kv_bytes: int, max_model_len: int, device: str):
    from elastic_hf import ElasticModel

    if kind == "fp":
        return ElasticModel.from_pretrained(None, kv_cache_memory=kv_bytes, max_model_len=max_model_len,
                                            device=device)
    mode = "default" if kind == "morph" else "manual"
    model = ElasticModel.from_pretrained(None, kv_cache_memory=kv_bytes, max_model_len=max_model_len, morph=mode,
                                         device=device, morph_options={"precisions": ("w4",)})
    if kind == "w4":
        model.morph.to_precision("all", "w4")
    return model


def perplexity_curve(order: list[int], ks: list[int], num_windows: int, seq_len: int) -> dict[int, float]:
    """Held-out wikitext perplexity with the first k layers of `order` in W4 (RTN, as served)."""
    from elastic_hf.layers.quant_scheme import QuantScheme
    from elastic_hf.layers.quantize_layer import quantize_decoder_layer, reference_layer
    from elastic_hf.model.loader import load_model_and_tokenizer
    from elastic_hf.profiling.calibration import default_calibration_text, tokenize_file
    from elastic_hf.profiling.perplexity import PerplexityEvaluator, eval_windows
    from elastic_hf.patches import get_adapter

    model, tokenizer, _ = load_model_and_tokenizer(None)
    adapter = get_adapter(model.config)
    layers = adapter.decoder_layers(model)
    scheme = QuantScheme.create("w4")
    references = {i: reference_layer(quantize_decoder_layer(layers[i], adapter, scheme, model.config))
                  for i in range(len(layers))}
    ids = tokenize_file(tokenizer, default_calibration_text())
    windows = eval_windows(ids[ids.numel() // 2:], seq_len, num_windows)  # second half: held out
    evaluator = PerplexityEvaluator(model, adapter, windows)
    return {k: evaluator.perplexity({i: references[i] for i in order[:k]}) for k in ks}


def interpolate(curve: dict[int, float], k: float) -> float:
    ks = sorted(curve)
    for lo, hi in zip(ks, ks[1:]):
        if lo <= k <= hi:
            return curve[lo] + (curve[hi] - curve[lo]) * (k - lo) / (hi - lo)
    return curve[ks[-1]]


def plot(path: str, recorder: Recorder, t0: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r[0] - t0 for r in recorder.rows]
    fig, ax1 = plt.subplots(figsize=(8, 4))
    ax1.plot(times, [r[3] for r in recorder.rows], color="tab:blue", label="KV blocks attached")
    ax1.set_xlabel("time since replay start (s)")
    ax1.set_ylabel("KV capacity (blocks of 16 tokens)", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.step(times, [r[2] for r in recorder.rows], where="post", color="tab:red", label="layers in W4")
    ax2.set_ylabel("decoder layers in W4", color="tab:red")
    ax1.set_title("MorphServe-style morphing: KV capacity and layers in W4 over the replay")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replay_regime(args, kinds: list[str], requests, kv_bytes: int, max_model_len: int) -> list[dict[str, tuple]]:
    """`args.runs` rounds of every server under one KV budget; runs[i][kind] = (report, recorder, replay start).
    The servers alternate within a round so drift in the machine's speed hits all of them alike."""
    runs: list[dict[str, tuple]] = []
    for run in range(args.runs):
        runs.append({})
        for kind in kinds:
            server = InProcessServer(lambda: load_model(kind, kv_bytes, max_model_len, args.device))
            model = server.model
            recorder = Recorder(model)
            try:
                start = time.time()
                report = run_replay(server.base_url, requests, ttft_slo_s=args.ttft_slo,
                                    tpot_slo_s=args.tpot_slo, progress=False)
                if kind == "morph":  # load is gone: give the controller time to restore everything
                    deadline = time.time() + 30
                    while model.morph.manager().counts()["fp"] < 30 and time.time() < deadline:
                        time.sleep(0.2)
            finally:
                server.stop()
            runs[-1][kind] = (report, recorder, start)
            state = model.morph.state() if model.morph is not None else None
            print(f"\n[run {run + 1}/{args.runs}: {kind}] KV blocks at end "
                  f"{model.instances[0].engine.scheduler.kv.num_total}; head of the queue waited for KV "
                  f"blocks {100 * recorder.kv_wait_share(report.duration_s):.0f} % of the time"
                  + (f"; swaps {state['swaps']}, mean swap latency {state['swap_latency_s_mean']} s" if state else ""))
            print(report.summary())
            del model, server
            gc.collect()
    return runs


def report_regime(args, kinds: list[str], runs, curve: dict[int, float], suffix: str, plot_path: str) -> None:
    """The table, the gains over static fp and the quality of one regime's runs, with RESULT lines (`suffix`
    names the regime)."""
    loss_w4 = curve[30] - curve[0]
    tokens: dict[int, float] = {}   # over all morph runs
    for run in runs:
        for k, n in run["morph"][1].tokens_by_w4_layers().items():
            tokens[k] = tokens.get(k, 0.0) + n
    total = sum(tokens.values()) or 1.0
    loss_morph = sum(n * (interpolate(curve, k) - curve[0]) for k, n in tokens.items()) / total
    share_quantized = sum(n * k for k, n in tokens.items()) / total / 30
    quality_kept = 1.0 - loss_morph / loss_w4 if loss_w4 > 0 else 1.0
    # perplexity of static W4 over morph's token-weighted perplexity: > 1, morph's text is better than static W4's
    quality_vs_w4 = curve[30] / (curve[0] + loss_morph)

    def gain(run, kind):   # fp's P95 TTFT over `kind`'s, within one run
        return run["fp"][0].ttft(95) / max(run[kind][0].ttft(95), 1e-9)

    gains = [gain(run, "morph") for run in runs]
    median_run = sorted(runs, key=lambda run: gain(run, "morph"))[len(runs) // 2]
    plot(plot_path, median_run["morph"][1], median_run["morph"][2])
    kv_wait = [run["fp"][1].kv_wait_share(run["fp"][0].duration_s) for run in runs]

    print(f"\nmedians over {args.runs} run(s) [min-max]")
    print("| server | TTFT P50 s | TTFT P95 s | TTFT P99 s | TPOT P99 s | SLO | tok/s | KV wait |\n"
          "|---|---|---|---|---|---|---|---|")
    for kind in kinds:
        def col(f, digits=3):
            return median_spread([f(run[kind]) for run in runs], digits)
        print(f"| {kind} | {col(lambda r: r[0].ttft(50))} | {col(lambda r: r[0].ttft(95))} | "
              f"{col(lambda r: r[0].ttft(99))} | {col(lambda r: r[0].tpot(99), 4)} | "
              f"{col(lambda r: 100 * r[0].slo_attainment, 1)} % | {col(lambda r: r[0].output_throughput, 1)} | "
              f"{col(lambda r: 100 * r[1].kv_wait_share(r[0].duration_s), 0)} % |")
    print(f"fp server's head of the queue waited for KV blocks {100 * statistics.median(kv_wait):.0f} % of the time "
          f"(runs: {', '.join(f'{100 * w:.0f} %' for w in kv_wait)})")
    print(f"morph P95 TTFT gain per run: {', '.join(f'{g:.2f}' for g in gains)} (median {statistics.median(gains):.2f}, "
          f"spread {min(gains):.2f}-{max(gains):.2f})")
    if "w4" in kinds:
        w4_gains = [gain(run, "w4") for run in runs]
        print(f"static W4 P95 TTFT gain per run: {', '.join(f'{g:.2f}' for g in w4_gains)} "
              f"(median {statistics.median(w4_gains):.2f})")
        print(f"RESULT static_w4_p95_ttft_gain{suffix} {statistics.median(w4_gains):.3g}")
    print(f"morph: {100 * share_quantized:.1f} % of (token x layer) products ran in W4; token-weighted perplexity "
          f"loss {loss_morph:.4f} vs static W4 {loss_w4:.4f}; plot (median run): {plot_path}")
    print(f"RESULT morph_p95_ttft_gain{suffix} {statistics.median(gains):.3g}")
    print(f"RESULT morph_p95_ttft_gain_min{suffix} {min(gains):.3g}")
    print(f"RESULT morph_p95_ttft_gain_max{suffix} {max(gains):.3g}")
    print(f"RESULT morph_fp_kv_wait_share{suffix} {statistics.median(kv_wait):.3g}")
    print(f"RESULT morph_quality_kept{suffix} {quality_kept:.3g}")
    print(f"RESULT morph_quality_vs_static_w4{suffix} {quality_vs_w4:.4g}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="code", help="code (prefill-heavy, the default) or conv (decode-heavy with "
                    "--max-output-tokens 512; on a 2-core CPU its KV demand still stays well below the cache at "
                    "the rates the compute keeps up with: benchmarks/RESULTS.md, session 50)")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--rate", type=float, default=1.5, help="mean arrival rate after time scaling (req/s)")
    ap.add_argument("--prompt-scale", type=float, default=1 / 8)
    ap.add_argument("--max-prompt-tokens", type=int, default=128)
    ap.add_argument("--max-output-tokens", type=int, default=32)
    add_weight_share_arg(ap)
    ap.add_argument("--kv-blocks", type=int, default=None,
                    help="an fp KV cache of this many blocks of 16 tokens instead of --weight-share (the old "
                         "regime: 16 blocks beside 540 MB of weights, weights ~97 %% of memory)")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.5)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-seq-len", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3, help="replays per server; the gain is the median over runs")
    ap.add_argument("--plot", default=str(result_path("morph_replay.png")))
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--servers", default="fp,w4,morph",
                    help="which servers to run, comma-separated (static W4 is impractical where the int-pack "
                         "kernels are much slower than fp32, e.g. this project's 2-core CI CPU)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    if not {"fp", "morph"} <= set(kinds) or not set(kinds) <= {"fp", "w4", "morph"}:
        ap.error(f"--servers must include fp and morph (and may include w4), got {args.servers!r}")
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir)
    rows = load_trace(args.trace, start=args.start, num_requests=args.num_requests)
    scale = TraceScale(time_scale_for_rate(rows, args.rate), args.prompt_scale, 1.0, args.max_prompt_tokens,
                       args.max_output_tokens)
    requests = build_requests(scale_trace(rows, scale), tokenizer)
    # a probe of the fp server: the weights' bytes, the KV block's bytes and the dtype the default model loads in
    probe = load_model("fp", 64 << 20, 256, args.device)
    report = probe.memory_report()
    block_bytes, dtype = report["kv_block_bytes"], probe.config.dtype
    weights = measured_weights_bytes(probe)
    probe.close()
    print(f"machine: {machine_description()}, device {args.device}, load average {os.getloadavg()[0]:.1f}")
    print(f"trace: {trace_path(args.trace).name} rows {args.start}..{args.start + len(rows) - 1}; scale: {scale.describe()}; "
          f"{len(requests)} requests at {args.rate} req/s")
    if args.kv_blocks is not None:
        regimes = [("", args.kv_blocks * block_bytes, f"fp KV cache {args.kv_blocks} blocks")]
    else:
        regimes = [(f"_{share_label(share)}", kv_bytes_for_share(weights, share),
                    f"weights {share:.0%} of the instance's memory")
                   for share in parse_weight_shares(args.weight_share)]
    order = list(range(30))
    curve = perplexity_curve(order, [0, 2, 4, 8, 12, 16, 22, 30], args.ppl_windows, args.ppl_seq_len)
    print("held-out perplexity with the first k layers in W4: "
          + ", ".join(f"k={k}: {v:.3f}" for k, v in curve.items()))
    for suffix, kv_bytes, label in regimes:
        num_blocks = kv_bytes // block_bytes
        print(f"\n=== regime: {label}: SmolLM2-135M-Instruct {dtype}, fp KV cache {kv_bytes / 2**20:.0f} MiB "
              f"({num_blocks} blocks x 16 tokens); the same budget for every server")
        runs = replay_regime(args, kinds, requests, kv_bytes, min(2048, max(256, num_blocks * 16)))
        plot_path = args.plot if not suffix else str(Path(args.plot).with_stem(Path(args.plot).stem + suffix))
        report_regime(args, kinds, runs, curve, suffix, plot_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
