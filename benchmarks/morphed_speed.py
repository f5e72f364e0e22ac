"""How fast a morphed model runs: the default model with every decoder layer in fp, W8 and W4 (precision morphing's
variants, morph="manual"), end to end through the engine, on our quantized kernels (native/quant_gemm.c) and on
aten's int-pack kernels (ELASTIC_HF_QUANT_GEMM=0, a second process: the layout is chosen when a layer is built).

    python benchmarks/morphed_speed.py [--dtype float32] [--rounds 3] [--batch 32] [--max-tokens 64]

Per precision: batch-1 decode (one request, time per output token after the first), an offline batch (`--batch`
prompts of 32-96 tokens, `--max-tokens` each: output tokens/s) and one 512-token prefill (`max_tokens=1`). The
precisions alternate within each round (a swap is a copy of the layers' images); medians over the rounds, with
their spread. "fp" is a morphing server's full precision: weights that may change are not prepacked, so its fp
linears run unpacked (the static server's prepacked fp32 is faster; benchmarks/vs_vllm.py times that one).
Prints ratios to fp and ours vs aten, and `RESULT morphed_<w8|w4>_<decode|batch|prefill>_vs_fp` (our kernels) and
`RESULT morphed_<w8|w4>_<...>_vs_aten`."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402

PRECISIONS = ("fp", "w8", "w4")
METRICS = ("decode", "batch", "prefill")   # decode: s per token; batch: tokens/s; prefill: s


def measure(args) -> dict:
    """This process's kernels: {precision: {metric: [one value a round]}}."""
    from tqdm import tqdm

    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(None, dtype=args.dtype, morph="manual", kv_cache_memory="512MiB",
                                         morph_options={"use_cache": False})
    tokenizer = model.tokenizer
    batch = wikitext_prompts(tokenizer, args.batch, 32, 96, seed=1)
    long_prompt = wikitext_prompts(tokenizer, 1, 512, 512, seed=2)[0]
    one = wikitext_prompts(tokenizer, 1, 32, 32, seed=3)[0]
    results = {p: {m: [] for m in METRICS} for p in PRECISIONS}
    with model, tqdm(total=args.rounds * len(PRECISIONS), desc=os.environ.get("KERNELS", "ours")) as bar:
        for _ in range(args.rounds):
            for precision in PRECISIONS:
                model.morph.to_precision("all", precision)
                model.generate(one, max_tokens=4, ignore_eos=True)                    # warm the swapped layers
                out = model.generate(one, max_tokens=args.max_tokens, ignore_eos=True)
                results[precision]["decode"].append((out.finish_time - out.first_token_time) / (args.max_tokens - 1))
                started = time.perf_counter()
                outs = model.generate(batch, max_tokens=args.max_tokens, ignore_eos=True)
                results[precision]["batch"].append(sum(len(o.outputs[0].token_ids) for o in outs)
                                                   / (time.perf_counter() - started))
                started = time.perf_counter()
                model.generate(long_prompt, max_tokens=1)
                results[precision]["prefill"].append(time.perf_counter() - started)
                bar.update()
        model.morph.to_precision("all", "fp")
    return results


def _median(values):
    return statistics.median(values), min(values), max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("CHILD_RESULT " + json.dumps(measure(args)))
        return

    print(machine_description())
    print(f"default model, {args.dtype}, {args.rounds} rounds; decode: 1 request x {args.max_tokens} tokens; batch: "
          f"{args.batch} prompts of 32-96 tokens x {args.max_tokens}; prefill: 512 tokens")
    runs = {}
    for kernels, flag in (("ours", "1"), ("aten", "0")):
        env = dict(os.environ, ELASTIC_HF_QUANT_GEMM=flag, KERNELS=kernels)
        child = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env, text=True,
                               stdout=subprocess.PIPE)
        lines = [line for line in child.stdout.splitlines() if line.startswith("CHILD_RESULT ")]
        if child.returncode != 0 or not lines:
            raise SystemExit(f"the {kernels} run failed (exit {child.returncode})")
        runs[kernels] = json.loads(lines[-1][len("CHILD_RESULT "):])

    units = {"decode": ("ms/token", 1e3), "batch": ("tok/s", 1.0), "prefill": ("ms", 1e3)}
    print("\n| kernels | precision | " + " | ".join(f"{m} {units[m][0]}" for m in METRICS) + " |")
    print("|---|---|" + "---|" * len(METRICS))
    for kernels, res in runs.items():
        for p in PRECISIONS:
            cells = []
            for m in METRICS:
                med, lo, hi = (v * units[m][1] for v in _median(res[p][m]))
                cells.append(f"{med:.1f} [{lo:.1f}-{hi:.1f}]")
            print(f"| {kernels} | {p} | " + " | ".join(cells) + " |")

    def speed(res, p, m):   # higher is better for every metric
        value = _median(res[p][m])[0]
        return value if m == "batch" else 1.0 / value

    print()
    for p in ("w8", "w4"):
        for m in METRICS:
            print(f"RESULT morphed_{p}_{m}_vs_fp {speed(runs['ours'], p, m) / speed(runs['ours'], 'fp', m):.3f}")
            print(f"RESULT morphed_{p}_{m}_vs_aten {speed(runs['ours'], p, m) / speed(runs['aten'], p, m):.3f}")


if __name__ == "__main__":
    main()
