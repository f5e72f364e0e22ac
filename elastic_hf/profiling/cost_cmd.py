"""Offline cost model for lookahead micro-batching (KunServe §4.3, eq. 1-3): time forwards of one worker over a grid
of micro-batches (prefix length x chunk size x chunks per micro-batch, decode batches, chunked-prefill mixes; median
of --repeats after a warm-up), time the final norm + LM head alone, fit its fixed and per-row cost, fit
alpha/beta/gamma/lambda by least squares to the rest of each forward, choose MIN (the
fewest tokens worth a micro-batch) and write cost-profile-<model>.json next to where `elastic-hf profile` writes
its LIS profile."""
from __future__ import annotations

import argparse
import os
import platform
import statistics
from pathlib import Path

import torch

from elastic_hf.engine.cost_model import fit, fit_head, relative_errors
from elastic_hf.profiling.cost_profile import GRIDS, MicroBatchTimer, grid_micro_batches, measure, measure_head
from elastic_hf.profiling.profile_cmd import default_out_path, report_usage_errors


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="local HF checkpoint directory or .gguf file; omit for the embedded default model")
    parser.add_argument("--dtype", default="float32", help="weights and KV dtype: float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--grid", default="full", choices=sorted(GRIDS),
                        help="micro-batches to time: small (short sequences, seconds) or full (prefixes up to "
                             "1k tokens, micro-batches up to 1k tokens)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per micro-batch (the median counts)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed forwards before them")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=None,
                        help="output JSON (default: cost-profile-<model>.json next to the checkpoint if writable, "
                             "else in the working directory)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def run(args) -> int:
    return report_usage_errors("profile-cost", _run, args)


def _run(args) -> int:
    from elastic_hf.model.loader import resolve_model

    if args.repeats < 1 or args.warmup < 0:
        raise ValueError(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats} and {args.warmup}")
    if args.threads:
        torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model, dtype=args.dtype, device=args.device)
    grid = GRIDS[args.grid]
    out_path = Path(args.out) if args.out else default_out_path(resolved.checkpoint_dir, resolved.model_id).with_name(
        f"cost-profile-{resolved.model_id}.json")
    probe = grid_micro_batches(grid, 1 << 30)
    timer = MicroBatchTimer(resolved.checkpoint_dir, resolved.dtype, args.device,
                            max_blocks=max(MicroBatchTimer.blocks_for(chunks, 16) for chunks in probe))
    micro_batches = grid_micro_batches(grid, timer.max_positions)
    print(f"timing {len(micro_batches)} micro-batches of {resolved.model_id} ({timer.num_layers} layers, "
          f"{args.dtype} on {timer.device}, {torch.get_num_threads()} threads): median of {args.repeats} after "
          f"{args.warmup} warm-up")
    samples = measure(timer, micro_batches, args.repeats, args.warmup, progress=not args.no_progress)
    head = fit_head(measure_head(timer, grid.head_rows, args.repeats, args.warmup))
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    model = fit(samples, timer.num_layers, source=f"{resolved.model_id} {args.dtype} on {timer.device} ({machine}, "
                                                  f"{torch.get_num_threads()} threads), grid {args.grid}", head=head)
    errors = relative_errors(model, samples)
    print(f"alpha {model.alpha:.4g} s per query-key pair   beta {model.beta:.4g} s per token   "
          f"gamma {model.gamma:.4g} s per chunk   lambda {model.lam:.4g} s shared per extra chunk   "
          f"head {model.head_fixed:.4g} s + {model.head:.4g} s per sampled row (timed alone at "
          f"{', '.join(map(str, grid.head_rows))} rows)")
    print(f"MIN {model.min_tokens} tokens per micro-batch; in-sample relative error mean "
          f"{statistics.mean(errors):.3f}, max {max(errors):.3f} over {len(samples)} micro-batches")
    model.save(out_path)
    print(f"wrote {out_path}")
    return 0
