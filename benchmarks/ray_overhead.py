"""What the Ray executor costs against the multiprocessing pool on one machine: start time, decode step time and
in-place reshape time ([1,1] -> [2] -> [1,1] with requests mid-decode), same model, same requests.

Both backends run `--runs` times, alternating (mp, ray, mp, ray, ...), each run a fresh deployment; Ray is started
once for the whole benchmark (a local cluster with this machine's cores), as a user's cluster would be. Medians
[min-max] over the runs; RESULT ray_step_overhead is Ray's median decode step over the pool's (target <= 1.1).

    python benchmarks/ray_overhead.py [--model PATH] [--runs 3] [--num-requests 8] [--steps 24]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description, wikitext_prompts  # noqa: E402

from elastic_hf import ElasticModel  # noqa: E402
from elastic_hf.engine.sampling_params import SamplingParams  # noqa: E402

BACKENDS = ("mp", "ray")


def one_run(args, backend: str) -> dict:
    started = time.perf_counter()
    model = ElasticModel.from_pretrained(args.model, workers=2, distributed_executor_backend=backend,
                                         kv_cache_memory=args.kv_mib << 20, enable_prefix_caching=False)
    start_s = time.perf_counter() - started
    dep = model.deployment
    try:
        prompts = wikitext_prompts(dep.tokenizer, args.num_requests, 32, 96, seed=0)
        model.generate(prompts[:2], max_tokens=4)   # warm-up: both instances, both kernels
        params = SamplingParams(temperature=0.0, max_tokens=args.steps * 3 + 64, ignore_eos=True)
        for p in prompts:
            dep.add_request(None, p, params)
        while any(s.num_computed_tokens < s.num_prompt_tokens for i in dep.instances
                  for s in i.engine.scheduler.running) or any(i.engine.scheduler.waiting for i in dep.instances):
            dep.step()                                # every prompt prefilled: what follows is decode
        step_s = []
        for _ in range(args.steps):
            t = time.perf_counter()
            dep.step()
            step_s.append(time.perf_counter() - t)
        up = dep.reshape([2])
        for _ in range(4):
            dep.step()
        down = dep.reshape([1, 1])
        return {"start_s": start_s, "step_ms": 1e3 * statistics.median(step_s),
                "reshape_ms": 1e3 * (up.seconds + down.seconds) / 2}
    finally:
        model.close()


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):8.2f} [{min(values):.2f}-{max(values):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--runs", type=int, default=3, help="runs per backend, alternating")
    parser.add_argument("--num-requests", type=int, default=8, help="requests decoding together (both instances)")
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps per run")
    parser.add_argument("--kv-mib", type=int, default=64, help="KV MiB per worker")
    args = parser.parse_args()

    import ray

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    results = {b: [] for b in BACKENDS}
    try:
        for _ in tqdm(range(args.runs), desc="runs (mp, ray alternating)"):
            for backend in BACKENDS:
                results[backend].append(one_run(args, backend))
    finally:
        ray.shutdown()

    print(f"\n{machine_description()}; 2 workers, {args.num_requests} requests, {args.steps} decode steps, "
          f"{args.runs} runs each (median [min-max])")
    print(f"{'':8s} {'start s':>22s} {'decode step ms':>22s} {'reshape ms':>22s}")
    for backend in BACKENDS:
        rows = results[backend]
        print(f"{backend:8s} {_fmt([r['start_s'] for r in rows]):>22s} {_fmt([r['step_ms'] for r in rows]):>22s} "
              f"{_fmt([r['reshape_ms'] for r in rows]):>22s}")
    median = {b: {k: statistics.median(r[k] for r in results[b]) for k in ("start_s", "step_ms", "reshape_ms")}
              for b in BACKENDS}
    for key, name in (("step_ms", "ray_step_overhead"), ("reshape_ms", "ray_reshape_overhead"),
                      ("start_s", "ray_start_overhead")):
        print(f"RESULT {name} {median['ray'][key] / median['mp'][key]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
