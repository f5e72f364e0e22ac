"""In-place reshape (TP layout change) vs restart-based reconfiguration, same model, same requests, one run.

In-place: a [1,1] deployment with requests mid-decode reshapes to [2] (MLP-first, KV migrated by head ranges, no
weight copy) and back. Restart: stop the workers, start a [2] deployment (new processes, checkpoint reload, groups),
re-submit the running requests with their generated tokens appended and re-prefill them up to the same state.
Also the KV-migration time and peak extra bytes, and the short-request throughput of N x TP1 vs TP-N.

    python benchmarks/reshape.py [--model PATH] [--num-requests 8] [--kv-mib 64]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_reshape_workload_args, machine_description, restart_and_reprefill,  # noqa: E402
                    running_state, wikitext_prompts)

from elastic_hf import ElasticModel  # noqa: E402
from elastic_hf.engine.sampling_params import SamplingParams  # noqa: E402
from elastic_hf.parallel.deployment import Deployment  # noqa: E402


def _steps(dep: Deployment, num_steps: int) -> None:
    for _ in range(num_steps):
        dep.step()


def _throughput(model: ElasticModel, prompts, max_new: int) -> float:
    start = time.perf_counter()
    outs = model.generate(prompts, max_tokens=max_new, ignore_eos=True)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reshape_workload_args(parser, max_new_tokens=48)
    parser.add_argument("--steps-before", type=int, default=6, help="decode steps before the reshape")
    parser.add_argument("--num-short", type=int, default=8, help="requests of the throughput comparison")
    args = parser.parse_args()

    t0 = time.perf_counter()
    model = ElasticModel.from_pretrained(args.model, workers=2, kv_cache_memory=args.kv_mib << 20)
    dep = model.deployment
    start_s = time.perf_counter() - t0
    prompts = wikitext_prompts(dep.tokenizer, args.num_requests, args.min_prompt, args.max_prompt, seed=0)
    short = wikitext_prompts(dep.tokenizer, args.num_short, 16, 48, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    try:
        model.generate(short[:2], max_tokens=4)  # warm-up both instances
        tput_tp1 = _throughput(model, short, 32)

        for p in prompts:
            dep.add_request(None, p, params)
        _steps(dep, args.steps_before)
        state = running_state(dep)
        live_tokens = sum(len(t) for t in state)
        before = dep.memory_report()
        up = dep.reshape([2])
        after = dep.memory_report()
        _steps(dep, 2)
        down = dep.reshape([1, 1])
        while dep.has_unfinished_requests():
            dep.step()
        dep.reshape([2])
        model.generate(short[:2], max_tokens=4)  # warm-up of the TP2 instance
        tput_tp2 = _throughput(model, short, 32)
        dep.reshape([1, 1])
    finally:
        model.close()

    # Restart-based: same running requests, same target topology [2].
    restart_s, reprefill = restart_and_reprefill(args.model, state, tp=2, kv_cache_memory=args.kv_mib << 20)

    kv = [s["kv"] for s in up.worker_stats]
    freed = [b["weights_bytes"] - a["weights_bytes"] for b, a in zip(before, after)]
    rss = [b["rss_anon_bytes"] - a["rss_anon_bytes"] for b, a in zip(before, after)]
    mib = lambda n: f"{n / 2**20:.2f} MiB"  # noqa: E731
    print(f"machine: {machine_description()}; model {dep.model_id}; 2 worker processes (gloo)")
    print(f"requests: {len(state)} mid-decode, {live_tokens} tokens in KV; deployment start {start_s:.1f} s")
    print(f"in-place [1,1]->[2]: {up.seconds * 1e3:.1f} ms; [2]->[1,1]: {down.seconds * 1e3:.1f} ms")
    print(f"  weights freed per worker: {[mib(f) for f in freed]} (RSS anon drop {[mib(r) for r in rss]})")
    print(f"  KV sent per worker {[mib(k['sent_bytes']) for k in kv]}, "
          f"kept local {[mib(k['local_bytes']) for k in kv]}, peak extra {[mib(k['peak_extra_bytes']) for k in kv]}")
    print(f"restart-based to [2]: {restart_s:.2f} s (new processes, checkpoint reload, {reprefill} tokens "
          f"re-prefilled)")
    print(f"short-request throughput: 2 x TP1 {tput_tp1:.1f} tok/s, TP2 {tput_tp2:.1f} tok/s")
    print(f"RESULT reshape_speedup {restart_s / up.seconds:.1f}")
    print(f"RESULT tp1_vs_tpn_throughput {tput_tp1 / tput_tp2:.2f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
