"""The engine's own Python per decode step (scheduling, batch building, sampling, detokenizing, building outputs):
does it grow with the output's length? One request of the default model decodes `--max-tokens` tokens with each
output kind; every step's wall time minus the runner's `execute` is the engine's part. Compared: the first
`--window` steps after the prompt against the last `--window`.

    python benchmarks/step_python.py [--max-tokens 2048] [--window 200] [--stop-strings]

CUMULATIVE copies the whole output so far into every output (vLLM's default kind, and what `stream()` gives
unless asked otherwise); DELTA (what the server streams) and FINAL_ONLY (its non-streaming responses, and
`generate()`) must stay flat. `--stop-strings` adds a stop string that never matches, so the hold-back and the
search run too. Prints `RESULT step_python_us_<kind>_<early|late>` and `RESULT step_python_growth_<kind>` (late /
early: 1.0 means flat).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import CallTimer, machine_description  # noqa: E402


def engine_python_per_step(model, kind, max_tokens: int, stop: list[str]) -> list[float]:
    """Seconds of engine Python of every step of one request, in order."""
    from elastic_hf import SamplingParams

    engine = model.deployment.instances[0].engine
    timer = CallTimer((engine.runner, "execute"), (engine.runner, "execute_sampled"))   # the runner's share
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=stop, output_kind=kind)
    model.deployment.add_request(f"step-python-{kind.value}", "Once upon a time, in a land far away,", params)
    per_step = []
    with tqdm(total=max_tokens, desc=kind.value, leave=False) as bar:
        while engine.has_unfinished_requests():
            timer.take()
            start = time.perf_counter()
            engine.step()
            per_step.append(time.perf_counter() - start - timer.take())
            bar.update(1)
    return per_step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=2048)
    parser.add_argument("--window", type=int, default=200, help="steps averaged at the start and at the end")
    parser.add_argument("--stop-strings", action="store_true", help="a stop string that never matches")
    args = parser.parse_args()
    if args.max_tokens < 4 * args.window:
        parser.error(f"--max-tokens ({args.max_tokens}) must be at least 4 x --window ({args.window})")

    from elastic_hf import ElasticModel, RequestOutputKind

    model = ElasticModel.from_pretrained(max_model_len=args.max_tokens + 64)
    stop = ["\u2603never-in-the-output\u2603"] if args.stop_strings else []
    print(f"machine: {machine_description()}; one request, {args.max_tokens} greedy tokens, "
          f"median of the first and last {args.window} decode steps, stop strings: {bool(stop)}")
    print(f"{'output kind':12s} {'early us/step':>14s} {'late us/step':>13s} {'late/early':>11s}")
    for kind in RequestOutputKind:
        steps = engine_python_per_step(model, kind, args.max_tokens, stop)[1:]   # [0] is the prefill
        early = statistics.median(steps[:args.window]) * 1e6
        late = statistics.median(steps[-args.window:]) * 1e6
        print(f"{kind.value:12s} {early:14.1f} {late:13.1f} {late / early:11.2f}")
        print(f"RESULT step_python_us_{kind.value}_early {early:.1f}")
        print(f"RESULT step_python_us_{kind.value}_late {late:.1f}")
        print(f"RESULT step_python_growth_{kind.value} {late / early:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
