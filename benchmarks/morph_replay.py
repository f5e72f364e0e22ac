"""Precision morphing under a replayed trace: static full precision vs static W4 (all layers) vs morphing
(default mode), side by side in one run, under the same memory budget (MorphServe §5).

The three servers run one after another in this process (uvicorn in a thread, like the serving tests) over the
default model. The fp KV cache is sized so full precision saturates: requests queue for KV blocks. Quality is
the held-out wikitext perplexity as a function of how many layers run in W4 (in the swap order), weighted by
the tokens each server generated at each layer count: static fp loses nothing, static W4 loses
ppl(all) - ppl(0), and `morph_quality_kept` = 1 - (morph's token-weighted loss) / (static W4's loss).

    python benchmarks/morph_replay.py [--num-requests 24 --rate 1.0 --kv-blocks 48 --plot morph_replay.png]
"""
from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import InProcessServer, machine_description  # noqa: E402
from replay import (TRACE_NAME, TraceScale, build_requests, load_trace, run_replay, scale_trace,  # noqa: E402
                    time_scale_for_rate)


class Recorder:
    """A step-boundary hook: (time, generated tokens so far, layers in W4, KV blocks) after every step."""

    def __init__(self, model):
        self.model = model
        self.rows: list[tuple[float, float, int, int]] = []
        model.instances[0].engine.step_boundary_hooks.append(self)

    def __call__(self, engine):
        morph = self.model.morph
        num_w4 = morph.manager().counts()["w4"] if morph is not None else 0
        tokens = engine.metrics.generation_tokens._value.get()
        self.rows.append((time.time(), tokens, num_w4, engine.scheduler.allocator.num_total))

    def tokens_by_w4_layers(self) -> dict[int, float]:
        """Tokens generated while k layers ran in W4 (a step's tokens count at the state before the step)."""
        out: dict[int, float] = {}
        for (_, tokens, k, _), (_, next_tokens, _, _) in zip(self.rows, self.rows[1:]):
            out[k] = out.get(k, 0.0) + (next_tokens - tokens)
        return out


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--rate", type=float, default=1.0, help="mean arrival rate after time scaling (req/s)")
    ap.add_argument("--prompt-scale", type=float, default=1 / 8)
    ap.add_argument("--max-prompt-tokens", type=int, default=384)
    ap.add_argument("--max-output-tokens", type=int, default=48)
    ap.add_argument("--kv-blocks", type=int, default=48, help="fp KV cache, in blocks of 16 tokens")
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tpot-slo", type=float, default=0.5)
    ap.add_argument("--ppl-windows", type=int, default=4)
    ap.add_argument("--ppl-seq-len", type=int, default=256)
    ap.add_argument("--plot", default="morph_replay.png")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--servers", default="fp,w4,morph",
                    help="which servers to run, comma-separated (static W4 is impractical where the int-pack "
                         "kernels are much slower than fp32, e.g. this project's 2-core CI CPU)")
    args = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir)
    rows = load_trace(None, start=args.start, num_requests=args.num_requests)
    scale = TraceScale(time_scale_for_rate(rows, args.rate), args.prompt_scale, 1.0, args.max_prompt_tokens,
                       args.max_output_tokens)
    requests = build_requests(scale_trace(rows, scale), tokenizer)
    block_bytes = 30 * 3 * 2 * 16 * 64 * 4   # SmolLM2-135M fp32: layers x kv heads x K/V x tokens x head_dim x 4 B
    kv_bytes = args.kv_blocks * block_bytes
    print(f"machine: {machine_description()}, device {args.device}, load average {os.getloadavg()[0]:.1f}")
    print(f"model: SmolLM2-135M-Instruct fp32; fp KV cache {args.kv_blocks} blocks x 16 tokens "
          f"({kv_bytes / 2**20:.1f} MiB); same budget for all servers")
    print(f"trace: {TRACE_NAME} rows {args.start}..{args.start + len(rows) - 1}; scale: {scale.describe()}; "
          f"{len(requests)} requests at {args.rate} req/s")

    kinds = [k.strip() for k in args.servers.split(",") if k.strip()]
    if not {"fp", "morph"} <= set(kinds) or not set(kinds) <= {"fp", "w4", "morph"}:
        ap.error(f"--servers must include fp and morph (and may include w4), got {args.servers!r}")
    reports, recorders, starts = {}, {}, {}
    for kind in kinds:
        model = load_model(kind, kv_bytes, min(512, args.kv_blocks * 16), args.device)
        recorder = Recorder(model)
        server = InProcessServer(model)
        try:
            starts[kind] = time.time()
            reports[kind] = run_replay(server.base_url, requests, ttft_slo_s=args.ttft_slo,
                                       tpot_slo_s=args.tpot_slo, progress=False)
            if kind == "morph":  # load is gone: give the controller time to restore everything
                deadline = time.time() + 30
                while model.morph.manager().counts()["fp"] < 30 and time.time() < deadline:
                    time.sleep(0.2)
        finally:
            server.stop()
        recorders[kind] = recorder
        state = model.morph.state() if model.morph is not None else None
        print(f"\n[{kind}] KV blocks at end {model.instances[0].engine.scheduler.allocator.num_total}"
              + (f", swaps {state['swaps']}, mean swap latency {state['swap_latency_s_mean']} s" if state else ""))
        print(reports[kind].summary())
        del model, server
        gc.collect()

    order = list(range(30))
    curve = perplexity_curve(order, [0, 2, 4, 8, 12, 16, 22, 30], args.ppl_windows, args.ppl_seq_len)
    print("\nheld-out perplexity with the first k layers in W4: "
          + ", ".join(f"k={k}: {v:.3f}" for k, v in curve.items()))
    loss_w4 = curve[30] - curve[0]
    tokens = recorders["morph"].tokens_by_w4_layers()
    total = sum(tokens.values()) or 1.0
    loss_morph = sum(n * (interpolate(curve, k) - curve[0]) for k, n in tokens.items()) / total
    share_quantized = sum(n * k for k, n in tokens.items()) / total / 30
    quality_kept = 1.0 - loss_morph / loss_w4 if loss_w4 > 0 else 1.0
    plot(args.plot, recorders["morph"], starts["morph"])

    print(f"\n{'server':8s} {'TTFT P50':>9s} {'P95':>8s} {'P99':>8s} {'TPOT P99':>9s} {'SLO':>6s} {'tok/s':>7s}")
    for kind, r in reports.items():
        print(f"{kind:8s} {r.ttft(50):9.3f} {r.ttft(95):8.3f} {r.ttft(99):8.3f} {r.tpot(99):9.4f} "
              f"{100 * r.slo_attainment:5.1f}% {r.output_throughput:7.1f}")
    print(f"morph: {100 * share_quantized:.1f} % of (token x layer) products ran in W4; token-weighted perplexity "
          f"loss {loss_morph:.4f} vs static W4 {loss_w4:.4f}; plot: {args.plot}")
    gain = reports["fp"].ttft(95) / max(reports["morph"].ttft(95), 1e-9)
    print(f"RESULT morph_p95_ttft_gain {gain:.3g}")
    print(f"RESULT morph_quality_kept {quality_kept:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
