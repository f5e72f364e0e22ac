"""Where a decode step's time goes: the default model, decode-only steps at several batch sizes, each step's wall
time split into GEMMs (linears and the LM head), attention (the native paged kernel or the torch path, K/V
writes), other tensor ops (norms, rotary, activations, residual adds, copies) and what no tensor op accounts for
(the engine's Python: scheduling, batch building, sampling, detokenizing, the step's framework glue).

    python benchmarks/step_profile.py [--dtype {float32,bfloat16}] [--batches 1 4 16 32] [--steps 10]
                                      [--context 128] [--packed-weights {auto,on,off}]

Every batch first prefills `--batches` prompts of `--context` tokens, then times `--steps` decode steps driven
through `engine.step()` under torch.profiler; the shares are of the summed step wall time. Prints a table per
batch and `RESULT step_ms_b<B> <ms>` and `RESULT step_non_gemm_share_b<B> <share>`; at batch 1 also the step
against the time to read its weights once at this machine's read bandwidth (benchmarks/decode_gemm.py's 1 GiB
stream, best of the readings taken before and after the batch's rounds): `RESULT step_vs_bandwidth_bound_b1`.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402
from decode_gemm import config_linear_shapes, read_bandwidth  # noqa: E402

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::linear", "mkldnn::_linear_pointwise", "aten::_weight_int4pack_mm",
            "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu", "mkl::_mkl_linear",
            "aten::mkldnn_linear")
ATTENTION_LABEL = "elastic::paged_attention"
GEMM_LABEL = "elastic::decode_gemm"     # native/decode_gemm.c through ctypes: no tensor op of its own
LABELS = (ATTENTION_LABEL, GEMM_LABEL)


def classify(name: str) -> str:
    if name in GEMM_OPS or name == GEMM_LABEL:
        return "gemm"
    return "other ops"


def top_level_ops(events) -> dict[str, float]:
    """Self-inclusive time (us) of every top-level tensor op (an op whose parent is not itself an op), by name:
    summing these never counts a nested op twice."""
    totals: dict[str, float] = defaultdict(float)
    for e in events:
        if e.device_type.name != "CPU":
            continue
        parent = e.cpu_parent
        inside_op = False
        while parent is not None:
            if parent.name.startswith(("aten::", "mkldnn::", "mkl::")) or parent.name in LABELS:
                inside_op = True
                break
            parent = parent.cpu_parent
        if inside_op:
            continue
        if e.name.startswith(("aten::", "mkldnn::", "mkl::")) or e.name in LABELS:
            totals[e.name] += e.cpu_time_total
    return totals


def profile_batch(model, prompts: list[list[int]], num_steps: int) -> dict[str, float]:
    from elastic_hf.engine.sampling_params import SamplingParams

    engine = model.instances[0].engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * num_steps + 4, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-b{len(prompts)}-{i}", prompt, params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for r in engine.requests.values() for s in r.seqs):
        engine.step()
    engine.step()   # one untimed decode step: every sequence is decoding from here on
    # The profiler's own cost per op inflates the step: time the same number of steps without it first.
    start = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    unprofiled_ms = (time.perf_counter() - start) / num_steps * 1e3

    # the native kernels run through ctypes: label the attention backend's forward (HF's layers reach it through the
    # AttentionInterface function, the fused layers directly) and the packed linears' native GEMM to see them
    backend = model.worker.instance.runner.attention
    original = backend.forward

    def labelled(*args, **kwargs):
        with record_function(ATTENTION_LABEL):
            return original(*args, **kwargs)

    backend.forward = labelled
    from elastic_hf.layers import packed_linear
    original_gemm = packed_linear.decode_gemm

    def labelled_gemm(*args):
        with record_function(GEMM_LABEL):
            return original_gemm(*args)

    packed_linear.decode_gemm = labelled_gemm
    # the lean decode step (layers/lean_decode.py) runs a layer's kernels inside one C call (native/lean_layer.c),
    # where no torch op marks them: it times them itself, by kind, while asked
    from elastic_hf.layers import lean_decode
    from elastic_hf.native import lean_layer
    kernel_seconds = lean_decode.time_kernels(True)
    try:
        walls = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(num_steps):
                start = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - start)
    finally:
        del backend.forward   # the class's method again
        packed_linear.decode_gemm = original_gemm
        lean_decode.time_kernels(False)
    while engine.has_unfinished_requests():
        engine.step()
    ops = top_level_ops(prof.events())
    wall_us = sum(walls) * 1e6
    shares = defaultdict(float)
    for name, us in ops.items():
        shares["attention" if name == ATTENTION_LABEL else classify(name)] += us
    for op, name in lean_layer.OP_NAMES.items():   # inside the C layer calls
        kind = {lean_layer.OP_GEMM: "gemm", lean_layer.OP_ATTEND: "attention",
                lean_layer.OP_KV_WRITE: "attention"}.get(op, "other ops")
        shares[kind] += kernel_seconds[op] * 1e6
        if kind == "other ops":   # listed among the largest other ops below
            ops[f"lean layer: {name}"] = kernel_seconds[op] * 1e6
    shares["python (no tensor op)"] = max(0.0, wall_us - sum(shares.values()))
    top_other = sorted(((us, n) for n, us in ops.items() if classify(n) == "other ops" and n != ATTENTION_LABEL),
                       reverse=True)[:6]
    return {"step_ms": unprofiled_ms, "profiled_step_ms": wall_us / num_steps / 1e3, "shares": {k: v / wall_us for k, v in shares.items()},
            "top_other": [(n, us / num_steps / 1e3) for us, n in top_other]}


def streamed_weight_bytes(checkpoint: str | None, dtype: str) -> int:
    """The bytes a decode step reads once whatever its batch: every decoder layer's linears and the LM head (an
    untied embedding table only gives its tokens' rows; norms are noise), in `dtype`."""
    from transformers import AutoConfig

    from elastic_hf.model.loader import resolve_model

    config = AutoConfig.from_pretrained(str(checkpoint or resolve_model(None).checkpoint_dir))
    layer, num_layers, (vocab, hidden) = config_linear_shapes(config.to_dict())
    elements = num_layers * sum(n * k for n, k in layer) + vocab * hidden
    return elements * torch.finfo(getattr(torch, dtype)).bits // 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--packed-weights", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--fused-layers", nargs="+", default=["auto"], choices=("auto", "off"),
                    help="decoder-layer forward(s) to time; both: side by side, alternating per round")
    ap.add_argument("--rounds", type=int, default=None, help="timed rounds per batch and mode (default: 3 when "
                                                              "comparing modes, else 1)")
    ap.add_argument("--model", default=None, help="a checkpoint directory or a shape of benchmarks/model_shapes.py "
                                                   "(default: the default model)")
    args = ap.parse_args(argv)
    if args.steps < 1 or min(args.batches) < 1:
        ap.error(f"--steps and --batches must be >= 1, got {args.steps} and {args.batches}")

    from elastic_hf import ElasticModel
    from model_shapes import SHAPES, prompt_tokenizer, random_checkpoint

    checkpoint = args.model
    if checkpoint in SHAPES:
        checkpoint = str(random_checkpoint(checkpoint))
    modes = list(dict.fromkeys(args.fused_layers))
    rounds = args.rounds or (3 if len(modes) > 1 else 1)
    models = {mode: ElasticModel.from_pretrained(checkpoint, dtype=args.dtype, packed_weights=args.packed_weights,
                                                 max_num_seqs=max(args.batches), max_num_batched_tokens=2048,
                                                 fused_layers=mode) for mode in modes}
    first = models[modes[0]]
    tokenizer = first.tokenizer if checkpoint is None else prompt_tokenizer(checkpoint)
    prompts = wikitext_prompts(tokenizer, max(args.batches), args.context, args.context)
    for model in models.values():
        model.generate(prompts[:2], max_tokens=4, ignore_eos=True)   # warm-up
    print(f"machine: {machine_description()}")
    print(f"model: {args.model or 'SmolLM2-135M-Instruct'} {args.dtype}, packed weights {args.packed_weights}; decode "
          f"steps at context ~{args.context}, {args.steps} steps per batch size; fused layers {', '.join(modes)}, "
          f"{rounds} round(s) alternating")
    weight_bytes = streamed_weight_bytes(checkpoint, args.dtype)
    for batch in args.batches:
        results = {mode: [] for mode in modes}
        bandwidth = read_bandwidth() if batch == 1 else 0.0
        for _ in range(rounds):
            for mode in modes:
                results[mode].append(profile_batch(models[mode], prompts[:batch], args.steps))
        if batch == 1:
            bandwidth = max(bandwidth, read_bandwidth())
            bound_ms = weight_bytes / bandwidth * 1e3
            print(f"\nbatch 1 bound: {weight_bytes / 1e6:.0f} MB of weights a step at {bandwidth / 1e9:.1f} GB/s "
                  f"(best reading) = {bound_ms:.1f} ms")
        for mode in modes:
            runs = results[mode]
            r = sorted(runs, key=lambda r: r["step_ms"])[len(runs) // 2]   # the median round
            spread = f" [{min(x['step_ms'] for x in runs):.1f}-{max(x['step_ms'] for x in runs):.1f}]" \
                if len(runs) > 1 else ""
            print(f"\nbatch {batch}, fused layers {mode}: {r['step_ms']:.1f}{spread} ms/step "
                  f"({r['profiled_step_ms']:.1f} under the profiler, which the shares are of)")
            for kind in ("gemm", "attention", "other ops", "python (no tensor op)"):
                print(f"  {kind:24s} {100 * r['shares'].get(kind, 0.0):5.1f} %")
            print("  largest other ops (ms/step): " + ", ".join(f"{n} {ms:.2f}" for n, ms in r["top_other"]))
            suffix = "" if len(modes) == 1 else f"_{mode}"
            print(f"RESULT step_ms_b{batch}{suffix} {r['step_ms']:.2f}")
            print(f"RESULT step_non_gemm_share_b{batch}{suffix} {1 - r['shares'].get('gemm', 0.0):.3f}")
            if batch == 1:
                print(f"RESULT step_vs_bandwidth_bound_b1{suffix} {r['step_ms'] / bound_ms:.3f}")
        if len(modes) == 2:
            med = {m: statistics.median(x["step_ms"] for x in results[m]) for m in modes}
            print(f"RESULT fused_layers_speedup_b{batch} {med['off'] / med['auto']:.3f}")
    for model in models.values():
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
