"""What the CPU step path gains from (1) the native one-pass RMSNorm and SwiGLU kernels and (2) stepping a model on
the thread that built it, on the default model, side by side in one run.

    python benchmarks/cpu_step_path.py [--dtype {float32,bfloat16}] [--repeats 3] [--skip-threads]

(1) One model, its norms and MLPs switched between the native modules and HF's eager ones between timed runs
    (rounds alternate, medians): prefill steps of 1 x 512, 4 x 256 and 2 x 512 tokens, decode steps at batch 1 and
    16. Prints `RESULT fused_elementwise_speedup_prefill_<dtype>` and `..._decode_<dtype>` (geometric means).
(2) Two fresh processes (the OpenMP pools are per process): one loads and steps the model on its main thread, the
    other loads it on the main thread and steps it on a second thread, as the server did before the engine thread
    built its own model. Prints `RESULT one_thread_speedup_decode_<dtype>` and `..._prefill_<dtype>`.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PROJECT_ROOT, machine_description  # noqa: E402

PREFILLS = ((1, 512), (4, 256), (2, 512))   # (prompts, tokens each), one step each
DECODE_BATCHES = (1, 16)
DECODE_STEPS = 10


def random_prompts(rng: random.Random, num: int, length: int) -> list[list[int]]:
    return [[rng.randint(100, 40000) for _ in range(length)] for _ in range(num)]


def time_prefill(model, rng, num: int, length: int) -> float:
    prompts = random_prompts(rng, num, length)
    start = time.perf_counter()
    model.generate(prompts, max_tokens=1)
    return time.perf_counter() - start


def time_decode(model, rng, batch: int) -> float:
    """Mean step time of DECODE_STEPS decode-only steps at `batch` sequences of ~64 tokens of context."""
    from elastic_hf.engine.sampling_params import SamplingParams

    engine = model.instances[0].engine
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(rng, batch, 64)):
        engine.add_request(f"decode-{time.monotonic_ns()}-{i}", prompt, params)
    engine.step()   # the prefill
    engine.step()
    start = time.perf_counter()
    for _ in range(DECODE_STEPS):
        engine.step()
    elapsed = (time.perf_counter() - start) / DECODE_STEPS
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed


def cases(model, rng) -> dict[str, callable]:
    out = {f"prefill {n}x{t}": (lambda n=n, t=t: time_prefill(model, rng, n, t)) for n, t in PREFILLS}
    out.update({f"decode b{b}": (lambda b=b: time_decode(model, rng, b)) for b in DECODE_BATCHES})
    return out


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


# ---------------------------------------------------------------- (1) fused elementwise kernels
def fused_elementwise(args) -> list[str]:
    from elastic_hf import ElasticModel
    from elastic_hf.layers.native_norm import NativeRMSNorm
    from elastic_hf.layers.swiglu_mlp import SwiGLUMLP

    model = ElasticModel.from_pretrained(dtype=args.dtype, max_num_batched_tokens=2048)
    hf_model = model.worker.hf_model
    norms = [m for m in hf_model.modules() if type(m) is NativeRMSNorm]
    mlps = [m for m in hf_model.modules() if type(m) is SwiGLUMLP]
    if not norms:
        print("no native norms (no C compiler or ELASTIC_HF_NATIVE=0): nothing to compare")
        return []
    eager = {id(m): m.eager_class for m in norms + mlps}
    print(f"{len(norms)} RMSNorms, {len(mlps)} MLPs switched between native and eager "
          f"({', '.join(sorted({c.__name__ for c in eager.values()}))})")

    def switch(native: bool) -> None:
        for module in norms:
            module.__class__ = NativeRMSNorm if native else eager[id(module)]
        for module in mlps:
            module.__class__ = SwiGLUMLP if native else eager[id(module)]

    rng = random.Random(0)
    work = cases(model, rng)
    times = {(name, native): [] for name in work for native in (True, False)}
    with tqdm(total=args.repeats * 2 * len(work), desc="fused elementwise") as bar:
        for _ in range(args.repeats):
            for native in (True, False):
                switch(native)
                for name, run in work.items():
                    run()   # warm: this shape's oneDNN primitives, the heap
                    times[(name, native)].append(run())
                    bar.update(1)
    switch(True)
    print(f"\n| {args.dtype} | eager ms | native ms | speedup |\n|---|---|---|---|")
    speedups = {}
    for name in work:
        eager, native = statistics.median(times[(name, False)]), statistics.median(times[(name, True)])
        speedups[name] = eager / native
        print(f"| {name} | {eager * 1e3:.1f} | {native * 1e3:.1f} | {eager / native:.3f} |")
    prefill = geomean([v for k, v in speedups.items() if k.startswith("prefill")])
    decode = geomean([v for k, v in speedups.items() if k.startswith("decode")])
    model.close()
    return [f"RESULT fused_elementwise_speedup_prefill_{args.dtype} {prefill:.3f}",
            f"RESULT fused_elementwise_speedup_decode_{args.dtype} {decode:.3f}"]


# ---------------------------------------------------------------- (2) one thread owns the OpenMP work
def thread_child(dtype: str, repeats: int, stepping_thread: str) -> dict[str, float]:
    """In this process: load on the main thread, time the cases on `stepping_thread` ("main" or "other")."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(dtype=dtype, max_num_batched_tokens=2048)
    result: dict[str, float] = {}

    def run_all() -> None:
        rng = random.Random(0)
        work = cases(model, rng)
        samples = {name: [] for name in work}
        for _ in range(repeats):
            for name, run in work.items():
                run()
                samples[name].append(run())
        result.update({name: statistics.median(v) for name, v in samples.items()})

    if stepping_thread == "main":
        run_all()
    else:
        thread = threading.Thread(target=run_all)
        thread.start()
        thread.join()
    model.close()
    return result


def one_thread(args) -> list[str]:
    runs = {}
    for stepping_thread in tqdm(("main", "other"), desc="thread ownership"):
        proc = subprocess.run([sys.executable, __file__, "--child", stepping_thread, "--dtype", args.dtype,
                               "--repeats", str(args.repeats)], capture_output=True, text=True, cwd=PROJECT_ROOT)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("CHILD ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"child ({stepping_thread}) failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
        runs[stepping_thread] = json.loads(lines[-1][len("CHILD "):])
    print(f"\n| {args.dtype} | loaded and stepped on one thread, ms | stepped on a second thread, ms | speedup |"
          "\n|---|---|---|---|")
    speedups = {}
    for name, same in runs["main"].items():
        other = runs["other"][name]
        speedups[name] = other / same
        print(f"| {name} | {same * 1e3:.1f} | {other * 1e3:.1f} | {other / same:.3f} |")
    prefill = geomean([v for k, v in speedups.items() if k.startswith("prefill")])
    decode = geomean([v for k, v in speedups.items() if k.startswith("decode")])
    return [f"RESULT one_thread_speedup_prefill_{args.dtype} {prefill:.3f}",
            f"RESULT one_thread_speedup_decode_{args.dtype} {decode:.3f}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case and setting; medians")
    parser.add_argument("--skip-threads", action="store_true", help="only the fused-kernel comparison")
    parser.add_argument("--child", choices=("main", "other"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("CHILD " + json.dumps(thread_child(args.dtype, args.repeats, args.child)), flush=True)
        return 0
    print(f"machine: {machine_description()}; default model, {args.dtype}")
    results = fused_elementwise(args)
    if not args.skip_threads:
        results += one_thread(args)
    print("\n" + "\n".join(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
