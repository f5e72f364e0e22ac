"""In-place TP x PP reshapes (ReMP) vs restart-based reconfiguration on 2 workers, every candidate pair, one run.

In-place: a [1,1] deployment with requests mid-decode walks [1,1] -> [2] -> [1x2] -> [1,1] -> [1x2] -> [2] -> [1,1]
(every ordered pair of the three candidates once), twice: with the weights loaded from the host store while the KV
migrates (overlapped, ReMP §3.3) and after it (sequential). Each reshape is split into KV time (the slowest worker's
migration) and weight time (loading + switching). Restart: start a deployment in the target topology (new
processes, checkpoint reload, groups) and re-prefill the running requests to the same state.

    python benchmarks/pp_reshape.py [--model PATH] [--num-requests 8] [--kv-mib 192]

Prints a table and `RESULT pp_reshape_speedup <restart / in-place, worst pair>`, `RESULT pp_overlap_gain
<sequential / overlapped, summed over the pairs that load weights>`.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (add_reshape_workload_args, machine_description, restart_and_reprefill,  # noqa: E402
                    running_state, wikitext_prompts)

from elastic_hf import ElasticModel  # noqa: E402
from elastic_hf.engine.sampling_params import SamplingParams  # noqa: E402

CYCLE = ["[1,1]", "[2]", "[1x2]", "[1,1]", "[1x2]", "[2]", "[1,1]"]


def _split(report) -> tuple[float, float]:
    """(KV seconds, weight seconds) of a reshape: the slowest worker of each."""
    kv = max((s.get("kv", {}).get("seconds", 0.0) for s in report.worker_stats), default=0.0)
    weights = max((s.get("preload", {}).get("seconds", 0.0) + s.get("weights_last_seconds", 0.0)
                   for s in report.worker_stats), default=0.0)
    return kv, weights


def _walk(dep, params, prompts, overlap: bool, steps_between: int, progress) -> dict[tuple[str, str], object]:
    ids = [dep.add_request(None, p, params) for p in prompts]
    for _ in range(steps_between * 2):
        dep.step()
    reports = {}
    for old, new in zip(CYCLE, CYCLE[1:]):
        reports[(old, new)] = dep.reshape(new, overlap_weights=overlap)
        progress.update()
        for _ in range(steps_between):
            dep.step()
    while dep.has_unfinished_requests():
        dep.step()
    assert all(r.committed for r in reports.values()), "a reshape rolled back"
    del ids
    return reports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_reshape_workload_args(parser, max_new_tokens=64)
    parser.add_argument("--steps-between", type=int, default=2, help="decode steps between two reshapes")
    args = parser.parse_args()

    model = ElasticModel.from_pretrained(args.model, workers=2, kv_cache_memory=args.kv_mib << 20)
    dep = model.deployment
    prompts = wikitext_prompts(dep.tokenizer, args.num_requests, args.min_prompt, args.max_prompt, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True)
    runs = {}
    try:
        model.generate(prompts[:2], max_tokens=4)  # warm-up
        with tqdm(total=2 * (len(CYCLE) - 1), desc="in-place reshapes") as progress:
            # Sequential first, so the overlapped walk cannot profit from pages a previous walk touched.
            for overlap in (False, True):
                runs[overlap] = _walk(dep, params, prompts, overlap, args.steps_between, progress)
        # The state a restart must rebuild: the requests mid-decode at the first reshape of the walk.
        for p in prompts:
            dep.add_request(None, p, params)
        for _ in range(2 * args.steps_between):
            dep.step()
        state = running_state(dep)
        while dep.has_unfinished_requests():
            dep.step()
    finally:
        model.close()

    restart = {}
    for target in tqdm(sorted(set(CYCLE)), desc="restarts"):
        restart[target] = restart_and_reprefill(args.model, state, topology=target.strip("[]"),
                                                kv_cache_memory=args.kv_mib << 20)[0]

    print(f"machine: {machine_description()}; model {dep.model_id}; 2 worker processes (gloo); "
          f"{len(state)} requests mid-decode, {sum(len(t) for t in state)} tokens in KV")
    print(f"{'pair':<16}{'overlapped ms':>14}{'sequential ms':>14}{'KV ms':>8}{'weights ms':>11}"
          f"{'KV sent MiB':>12}{'restart s':>10}{'speedup':>9}")
    speedups, seq_total, ovl_total = [], 0.0, 0.0
    for pair, report in runs[True].items():
        sequential = runs[False][pair]
        kv_s, w_s = _split(report)
        sent = report.kv_plan_bytes.get("sent", 0) / 2**20
        speedup = restart[pair[1]] / report.seconds
        speedups.append(speedup)
        if _split(sequential)[1] > 0:
            seq_total += sequential.seconds
            ovl_total += report.seconds
        print(f"{pair[0] + '->' + pair[1]:<16}{report.seconds * 1e3:>14.1f}{sequential.seconds * 1e3:>14.1f}"
              f"{kv_s * 1e3:>8.1f}{w_s * 1e3:>11.1f}{sent:>12.2f}{restart[pair[1]]:>10.2f}{speedup:>9.1f}")
    print(f"RESULT pp_reshape_speedup {min(speedups):.1f}")
    print(f"RESULT pp_overlap_gain {seq_total / ovl_total if ovl_total else 1.0:.3f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
