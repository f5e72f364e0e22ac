"""The KunServe §4.3 cost model (eq. 1-3) against the token-linear model that token-count chunking assumes, and
lookahead micro-batches against equal-token ones, on one in-process worker of the real data plane.

    python benchmarks/cost_model.py [--model PATH] [--grid full] [--held-out 48] [--steps 6] [--tiny]

1. Fit both models on the profiling grid of `elastic-hf profile-cost` (elastic_hf/profiling/cost_profile.py).
2. Predict held-out random micro-batches (fresh chunks, chunks after a long prefix, decode batches and mixes of
   the three, inside the grid's ranges) and compare with their measured time (median of --repeats forwards).
3. Cut burst-like chunked-prefill steps (running decodes, a long prompt's next chunk, new prompts filling the token
   budget) into --num-stages micro-batches by cost (lookahead) and by token count, and time every micro-batch
   as a whole-model forward (each stage runs its share of the same forward). max/min micro-batch time is what a
   pipeline waits on: 1.0 means no bubble from imbalance.

Prints a table and `RESULT cost_model_error`, `RESULT token_linear_error` (mean relative error on held-out),
`RESULT lookahead_balance`, `RESULT token_count_balance` (measured max/min micro-batch time, mean over steps).
--tiny: the small grid and a few micro-batches (a quick check, seconds to a minute).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_description  # noqa: E402

from elastic_hf.engine.cost_model import Chunk, fit, fit_token_linear, relative_errors  # noqa: E402
from elastic_hf.engine.lookahead import (WorkItem, balance, lookahead_split, piece_chunks,  # noqa: E402
                                         predicted_costs, token_count_split)
from elastic_hf.model.loader import resolve_model  # noqa: E402
from elastic_hf.profiling.cost_profile import GRIDS, Grid, MicroBatchTimer, grid_micro_batches, measure  # noqa: E402

KINDS = ("fresh chunks", "long-prefix chunks", "decodes", "mixed")


def held_out_batch(kind: str, rng: random.Random, grid: Grid) -> list[Chunk]:
    """A random micro-batch of `kind` inside the grid's ranges (prefix, chunk and token budget)."""
    max_prefix, max_chunk = max(grid.prefixes + grid.decode_prefixes), max(grid.chunks)
    low_chunk = min(grid.chunks)
    fresh = lambda: Chunk(0, rng.randint(low_chunk, max_chunk), rng.random() < 0.5)  # noqa: E731
    later = lambda: Chunk(rng.randint(max_prefix // 4, max_prefix), rng.randint(low_chunk, max_chunk),  # noqa: E731
                          rng.random() < 0.5)
    decode = lambda: Chunk(rng.randint(16, max_prefix), 1, True)  # noqa: E731
    if kind == "fresh chunks":
        chunks = [fresh() for _ in range(rng.randint(1, 4))]
    elif kind == "long-prefix chunks":
        chunks = [later() for _ in range(rng.randint(1, 3))]
    elif kind == "decodes":
        chunks = [decode() for _ in range(rng.randint(1, max(grid.decode_batches)))]
    else:
        chunks = [later(), fresh()] + [decode() for _ in range(rng.randint(1, 8))]
    # At most 4 chunks of max(grid.chunks) or 2 and 8 decodes: every grid's token budget holds them.
    assert sum(c.tokens for c in chunks) <= grid.max_tokens, (kind, chunks)
    return chunks


def burst_step(rng: random.Random, grid: Grid) -> list[WorkItem]:
    """One chunked-prefill step under a burst, in the scheduler's order: running decodes, the next chunk of a long
    prompt, then new prompts until the token budget is full (the last one chunked, so it does not sample)."""
    max_prefix, max_chunk = max(grid.prefixes + grid.decode_prefixes), max(grid.chunks)
    items = [WorkItem(rng.randint(16, max_prefix), 1, True) for _ in range(rng.randint(0, 8))]
    items.append(WorkItem(rng.randint(max_prefix // 2, max_prefix), rng.randint(max_chunk // 2, max_chunk), False))
    budget = grid.max_tokens - sum(item.tokens for item in items)
    while budget > 0:
        length = rng.randint(min(grid.chunks), max_chunk)
        items.append(WorkItem(0, min(length, budget), length <= budget))
        budget -= items[-1].tokens
    return items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--grid", default="full", choices=sorted(GRIDS), help="training grid")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per micro-batch (median)")
    parser.add_argument("--held-out", type=int, default=48, help="held-out random micro-batches")
    parser.add_argument("--steps", type=int, default=6, help="burst steps split into micro-batches")
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--tiny", action="store_true", help="small grid, 12 held-out, 2 steps: a quick run")
    parser.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    args = parser.parse_args()
    if args.tiny:
        args.grid, args.held_out, args.steps = "small", 12, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    grid, rng, progress = GRIDS[args.grid], random.Random(args.seed), not args.no_progress
    held_out = [held_out_batch(KINDS[i % len(KINDS)], rng, grid) for i in range(args.held_out)]
    steps = [burst_step(rng, grid) for _ in range(args.steps)]
    resolved = resolve_model(args.model, dtype=args.dtype)
    everything = grid_micro_batches(grid, 1 << 30) + held_out + [[Chunk(*item) for item in items] for items in steps]
    timer = MicroBatchTimer(resolved.checkpoint_dir, resolved.dtype,
                            max_blocks=max(MicroBatchTimer.blocks_for(c) for c in everything))
    print(f"{machine_description()}; {resolved.model_id} {args.dtype}, grid {args.grid}, median of {args.repeats}")
    print("note: a 2-core VM is noisy; other processes on it slow some forwards (the medians absorb short bursts)")

    train = measure(timer, grid_micro_batches(grid, timer.max_positions), args.repeats, progress=progress,
                    desc="training grid")
    model, baseline = fit(train, timer.num_layers, source=resolved.model_id), fit_token_linear(train)
    print(f"eq. 1-3: alpha {model.alpha:.3g} beta {model.beta:.3g} gamma {model.gamma:.3g} lambda {model.lam:.3g} "
          f"head {model.head:.3g} MIN {model.min_tokens}; token-linear: {baseline.per_token:.3g} s/token + "
          f"{baseline.fixed:.3g} s")
    tested = measure(timer, held_out, args.repeats, progress=progress, desc="held-out")

    print(f"\n{'held-out micro-batches':<22}{'count':>7}{'eq. 1-3 error':>16}{'token-linear error':>20}")
    for kind in KINDS:
        rows = [sample for i, sample in enumerate(tested) if KINDS[i % len(KINDS)] == kind]
        print(f"{kind:<22}{len(rows):>7}{statistics.mean(relative_errors(model, rows)):>16.3f}"
              f"{statistics.mean(relative_errors(baseline, rows)):>20.3f}")
    model_error = statistics.mean(relative_errors(model, tested))
    linear_error = statistics.mean(relative_errors(baseline, tested))
    print(f"{'all':<22}{len(tested):>7}{model_error:>16.3f}{linear_error:>20.3f}")

    print(f"\n{'split into ' + str(args.num_stages) + ' micro-batches':<26}{'predicted max/min':>18}"
          f"{'measured max/min':>18}   measured seconds per micro-batch (step by step)")
    splits = {"lookahead": [lookahead_split(items, model, args.num_stages) for items in steps],
              "token count": [token_count_split(items, args.num_stages) for items in steps]}
    # Every micro-batch of both splits in one measurement, in rounds: load elsewhere hits both alike.
    flat = [piece_chunks(mb, items) for name in splits for items, mbs in zip(steps, splits[name]) for mb in mbs]
    seconds = iter(t for _, t in measure(timer, flat, args.repeats, progress=progress, desc="micro-batches"))
    measured_balance = {}
    for name, per_step in splits.items():
        predicted = [balance(predicted_costs(mbs, items, model)) for items, mbs in zip(steps, per_step)]
        measured = [[next(seconds) for _ in mbs] for mbs in per_step]
        measured_balance[name] = statistics.mean(balance(times) for times in measured)
        shown = "  ".join("/".join(f"{t:.2f}" for t in times) for times in measured)
        print(f"{name:<26}{statistics.mean(predicted):>18.3f}{measured_balance[name]:>18.3f}   {shown}")

    print(f"RESULT cost_model_error {model_error:.4f}")
    print(f"RESULT token_linear_error {linear_error:.4f}")
    print(f"RESULT lookahead_balance {measured_balance['lookahead']:.4f}")
    print(f"RESULT token_count_balance {measured_balance['token count']:.4f}")


if __name__ == "__main__":
    main()
