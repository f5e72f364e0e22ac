"""KunServe parameter dropping under the largest burst of the Azure code trace, side by side with data parallelism,
a static pipeline, a TP merge and precision morphing on the same 2 workers and the same KV budget per worker, plus
the ablations of KunServe §5.3/§5.5 (blocking exchange, coordinated exchange, lookahead, no restore) and, on
request (`--configs ...,lifted`), the exchange at full speed while requests queue for its memory, and
(`--configs ...,dp-routed`) data parallelism with each request kept where routing put it on arrival (no queue
rebalancing: what "dp" was before session 56).

    python benchmarks/param_drop.py [--num-requests auto --weight-share 0.5,0.3 --runs 3 --configs dp,pp,kunserve
                                     --cost-profile PATH --plot out/benchmarks/param_drop.png]

The memory regime is the papers' (benchmarks/regime.py): each worker's KV budget is sized from its measured weights
so that the weights are --weight-share of weights + KV (default 0.5, then 0.3; KunServe §5.1: 34-74 %).
--kv-cache-memory sets the KV bytes directly instead (the old 16 MiB default put the weights at ~97 %, where any
freed layer multiplied the capacity ten-fold). Static PP 1x2 is the honest control for dropping: the same capacity
during the burst (the layer split that holds the most KV, as a drop under a burst takes), no elasticity.

How the workload is chosen (every rule prints its numbers):

- Window: the --num-requests consecutive trace rows whose peak arrival rate (over a sliding sub-window of a quarter
  of them) is highest relative to the window's mean rate, i.e. the highest peak once time scaling has fixed the
  mean, with the peak at least an eighth of the window from either end (a lead-in and a tail, so the drop and the
  restore both happen) and no idle gap longer than max(10 %, 3 mean inter-arrivals) of the window's span (a long
  idle gap would make any burst look large relative to the mean while the replay mostly sleeps). With
  --num-requests auto (the default) the size is chosen per weight share: the smallest of 80 / 90 / 100 / 110 / 120 /
  140 / 160 / 180 / 200 / 240 rows whose burst asks for at least --burst-peak (95 %) of the DP capacity, by a fluid
  estimate at the solved rate (fluid_peak_demand: no queue, no KV limit, the decode step of the current load from
  the calibration). A burst that stays below the capacity overflows nothing and the drop configs serve exactly as
  DP: session 69's 80-row window (fluid peak 76-80 % at weight share 0.5) overflowed in 1 of 6 drop replays. The
  estimate has no queue, so the replay overflows at a lower fluid peak than 100 %, and far more above it: the
  120-row window (141 %) held a mean demand of 128-148 % of the DP capacity while requests arrived (DP's P99 TTFT
  182-209 s), a compute overload that does not drain within the window rather than a burst above a 55 % mean. The
  larger KV of weight share 0.3 needs a larger window (~140 rows) for the same overflow.
- Lengths: prompts x --prompt-scale (1/4, cap 512) and outputs x --output-scale (x32, cap 768), capped so every
  request (prompt + output) takes at most 80 % of one data-parallel instance's KV: every request's KV stays
  resident on one DP instance. The code trace is prefill-heavy (median 1,240 prompt tokens, 13 outputs); a 2-core
  CPU prefills at ~2 ms a token and a decode step at batch 64 costs 3.3x one at batch 1, so with short outputs
  holding 55 % of the papers'-regime KV needs the prefill at >= 90 % of the instances' time: the queue grows for
  compute, not memory, and no drop ever happens (measured with x8 / cap 384 outputs and prompts x1/16: mean KV
  demand 23 % of the DP capacity, no drop at either share). Decode-heavy requests (the papers' conversation
  workloads) hold more KV per unit of compute: at these defaults the prefill takes ~12 % of an instance's time and
  the largest burst of the 80-row window asks for ~60 % of the DP capacity on top of the mean (at weight share 0.5;
  at 0.3 the same burst is ~26 % of a KV 2.3x larger and overflows nothing: hence the larger windows of `auto`).
- Time scale (KunServe §5.1: the mean memory demand stays below 60 % of the memory): the mean arrival rate r is
  solved so that the mean KV demand (Little's law: r x the mean KV token-seconds of a request) is --target-util
  (55 %) of the DP capacity. A request's KV token-seconds are its prefill time x its prompt plus its decode time x
  (prompt + output / 2), with the prefill time and the per-instance decode step time at the expected concurrency
  measured on a DP deployment first, every instance at once at the window's mean decode context (decode steps slowed
  by the prefills sharing them: TPOT = step / (1 - prefill utilisation)); the concurrency depends on the rate, so r
  is a fixed point. The burst then asks for several times the capacity.
- SLOs (KunServe §5.2 uses 5x the P50 latency of the best baseline): --slo-scale (5) x the DP deployment's unloaded
  TTFT and TPOT of a request of the window's median prompt and output length, measured one request at a time through
  the same HTTP path as the replay.
- Hysteresis, the same for every drop / merge config: react after 2 overloaded steps (KunServe drops as soon as the
  monitor sees the overload; 2 filters a one-step blip), overloaded meaning the demand above the capacity or, past 80 %
  of it, the demand projected 64 steps ahead at its growth over the last 32 (OverloadConfig.lead_steps), restore below 50 % of the undropped capacity (§4.4) held for
  about 2 mean inter-arrival times of the scaled trace, cool down for about 5 (counted in decode steps at the expected
  concurrency), so a lull between two arrivals inside the burst does not restore and re-drop.

Every config is a fresh 2-worker ElasticModel behind the OpenAI app in this process (uvicorn in a thread), replayed
open loop (benchmarks/replay.py), one after another, --runs times alternating configs; tables give medians with
[min-max] and ratios are taken per run (run i of each config) before the median. Prints a table per config, ratios vs
dp, the DP decode step time vs batch size (memory- or compute-bound), `RESULT` lines and a plot of TTFT over arrival time with the drop / merge /
restore moments and the KV demand and capacity. Longer than 400 lines because the workload rules, the DP calibration
they rest on, the eight configs and their report form one runnable script."""
from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import InProcessServer, machine_description, result_path, wikitext_prompts  # noqa: E402
from regime import (add_weight_share_arg, kv_bytes_for_share, measured_weights_bytes, median,  # noqa: E402
                    median_spread, parse_weight_shares, share_label)
from replay import (TRACE_NAME, ReplayReport, ReplayRequest, TraceRow, TraceScale, build_requests,  # noqa: E402
                    load_trace, percentile, run_replay, scale_trace, time_scale_for_rate)
from elastic_hf.config import EngineConfig  # noqa: E402
from elastic_hf.parallel.metrics import PIPELINE_PARTS  # noqa: E402

CONFIGS = ("dp", "pp", "tp-merge", "morph", "kunserve", "+drop", "+exchange", "no-restore", "lifted", "dp-routed")
# On request: "lifted", the exchange at full speed while requests queue; "dp-routed", data parallelism whose requests
# stay where routing put them on arrival (no queue rebalancing, engine/rebalance.py: the engine before session 56)
DEFAULT_CONFIGS = CONFIGS[:-2]
ALIASES = {"+lookahead": "kunserve"}
DROP_CONFIGS = ("kunserve", "+drop", "+exchange", "no-restore", "lifted")
STEP_BATCHES = (1, 4, 8, 16, 32)  # sequences per instance; beyond 32 the step grows linearly (extrapolated), and
                                 # every one is prefilled at the window's mean decode context
REQUEST_KV_SHARE = 0.8      # a request (prompt + output) takes at most this share of one DP instance's KV
CALIBRATION_KV_BLOCKS = 256  # the calibration deployment's least KV per worker (its prefill probes)
CALIBRATION_DECODE_SLACK = 96  # tokens a step-table sequence may decode before the last one's prefill ends
BLOCK_TOKENS = EngineConfig().block_size  # tokens per KV block of every deployment here (the engine's default)
# --num-requests auto: the candidate window sizes, smallest first
AUTO_WINDOW_SIZES = (80, 90, 100, 110, 120, 140, 160, 180, 200, 240)
PREFILL_UTIL_CAP = 0.9      # the rate solver's cap on the prefill share of an instance's time
MAX_NUM_SEQS = 256          # per instance (vLLM's default): KV, not a sequence cap, bounds the batch
RESTORE_HOLD_ARRIVALS = 2.0  # restore after about this many mean inter-arrival times of low demand
COOLDOWN_ARRIVALS = 5.0


# ---------------------------------------------------------------- the window
@dataclass(slots=True)
class Window:
    start: int
    rows: list[TraceRow]
    sub: int              # arrivals of the sliding sub-window the peak is measured over
    peak_offset: int      # first row of the peak sub-window, relative to start
    mean_rate: float      # req/s of the trace (unscaled)
    peak_rate: float

    @property
    def burst_factor(self) -> float:
        return self.peak_rate / self.mean_rate


def find_burst_window(all_rows: list[TraceRow], n: int) -> Window:
    """The window of `n` consecutive rows with the highest peak rate relative to its mean rate (see the module
    docstring for the constraints)."""
    t = [r.arrival_s for r in all_rows]
    if n < 4 or n > len(t):
        raise ValueError(f"--num-requests must be in [4, {len(t)}], got {n}")
    k = max(3, n // 4)
    lead = n // 8
    peak = [(k - 1) / max(t[i + k - 1] - t[i], 1e-3) for i in range(len(t) - k + 1)]
    gaps = [t[i + 1] - t[i] for i in range(len(t) - 1)]
    best = None
    for relaxed in (False, True):
        for s in range(len(t) - n + 1):
            span = t[s + n - 1] - t[s]
            if span <= 0 or (not relaxed and max(gaps[s:s + n - 1]) > max(0.1, 3 / (n - 1)) * span):
                continue
            j = max(range(s + lead, s + n - k - lead + 1), key=peak.__getitem__)
            mean = (n - 1) / span
            if best is None or peak[j] / mean > best[0]:
                best = (peak[j] / mean, s, j - s, mean, peak[j])
        if best is not None:
            break
    _, s, offset, mean, pk = best
    return Window(s, load_trace(None, start=s, num_requests=n), k, offset, mean, pk)


def length_caps(args, instance_tokens: int) -> tuple[int, int]:
    """The prompt and output caps, shrunk together so that a request fits REQUEST_KV_SHARE of one DP instance."""
    cap_p, cap_o = args.max_prompt_tokens, args.max_output_tokens
    room = int(REQUEST_KV_SHARE * instance_tokens)
    if cap_p + cap_o > room:
        f = room / (cap_p + cap_o)
        cap_p, cap_o = max(1, int(cap_p * f)), max(1, int(cap_o * f))
    return cap_p, cap_o


# ---------------------------------------------------------------- serving in this process
class Timeline:
    """Wraps the deployment's step (it runs on the engine thread, between steps, where reading the control plane is
    safe): after every step the KV demand and capacity (the arbiter's snapshot) and any new overload history entry,
    stamped with the time of the step boundary it appeared at."""

    def __init__(self, dep):
        self.dep = dep
        self.rows: list[tuple[float, int, int, str]] = []    # (time, demand tokens, capacity tokens, topology)
        self.events: list[tuple[float, dict]] = []
        self._seen = len(dep.overload.history)
        self._step = dep.step
        dep.step = self.step

    def step(self):
        out = self._step()
        now = time.perf_counter()
        overload = self.dep.overload
        snap = overload.snapshot()
        self.rows.append((now, snap.demand_tokens, snap.capacity_tokens, str(self.dep.topology)))
        for entry in overload.history[self._seen:]:
            self.events.append((now, dict(entry)))
        self._seen = len(overload.history)
        return out

    def mean_demand(self, t0: float, t1: float) -> float:
        """Time-weighted mean KV demand (tokens) over [t0, t1], the demand held from one step boundary to the next."""
        rows = [r for r in self.rows if t0 <= r[0] <= t1]
        if len(rows) < 2:
            return float("nan")
        area = sum(a[1] * (b[0] - a[0]) for a, b in zip(rows, rows[1:]))
        return area / (rows[-1][0] - rows[0][0])


# ---------------------------------------------------------------- calibration on a DP deployment
@dataclass
class Calibration:
    step_s: dict[int, float]        # per-instance decode step seconds by batch size
    prefill_fixed_s: float          # prefill of a P-token prompt alone: fixed + per_token x P
    prefill_per_token_s: float
    unloaded_ttft_s: float
    unloaded_tpot_s: float
    block_bytes: int
    probe: tuple[int, int] = (0, 0)  # (prompt, output) tokens of the unloaded probe
    context: int = 0                 # tokens a sequence of the step table holds (the window's mean decode context)

    def step_at(self, batch: float) -> float:
        """Decode step seconds of one instance at `batch` sequences (piecewise linear, extrapolated beyond)."""
        xs = sorted(self.step_s)
        batch = max(batch, xs[0])
        for lo, hi in zip(xs, xs[1:]):
            if batch <= hi:
                return self.step_s[lo] + (self.step_s[hi] - self.step_s[lo]) * (batch - lo) / (hi - lo)
        lo, hi = xs[-2], xs[-1]
        return self.step_s[hi] + (self.step_s[hi] - self.step_s[lo]) * (batch - hi) / (hi - lo)

    def prefill_s(self, prompt: int) -> float:
        return self.prefill_fixed_s + self.prefill_per_token_s * prompt


def _run_until_first_tokens(dep, request_ids: set[str]) -> set[str]:
    """Steps until every request has a token; returns those that finished on the way."""
    pending, finished = set(request_ids), set()
    while pending:
        for out in dep.step():
            pending.discard(out.request_id)
            if out.finished:
                finished.add(out.request_id)
    return finished


def decode_step_table(dep, tokenizer, batches, context: int, steps: int = 4) -> dict[int, float]:
    """Seconds per decode step of one DP instance holding b sequences of ~`context` tokens while every other
    instance holds as many (the replay's instances step at once and share the memory bandwidth, and a step reads
    every sequence's KV: instance 0 alone at 32-token prompts gave about half the step time at 16 sequences), after
    their prefill, through the engine (Deployment.step: scheduling, the worker RPCs, sampling)."""
    from elastic_hf.engine.sampling_params import SamplingParams

    out = {}
    instances = len(dep.instances)
    # Long prefills take several chunked steps, in which the first sequences already decode: they must not finish
    # before the last one starts (CALIBRATION_DECODE_SLACK tokens of room), and are aborted once timed.
    params = SamplingParams(temperature=0.0, max_tokens=CALIBRATION_DECODE_SLACK, ignore_eos=True)
    for b in batches:
        ids = {dep.add_request(None, p, params, instance=i)
               for i in range(instances)
               for p in wikitext_prompts(tokenizer, b, context, context, seed=b * instances + i)}
        finished = _run_until_first_tokens(dep, ids)
        finished.update(o.request_id for o in dep.step() if o.finished)
        started = time.perf_counter()
        for _ in range(steps):
            finished.update(o.request_id for o in dep.step() if o.finished)
        out[b] = (time.perf_counter() - started) / steps
        if finished:   # the batch shrank before or while it was timed
            raise RuntimeError(f"calibration at batch {b}: {len(finished)} of {len(ids)} sequences finished before "
                               f"the timed steps ended (CALIBRATION_DECODE_SLACK {CALIBRATION_DECODE_SLACK} too small)")
        for request_id in ids:
            dep.abort_request(request_id)
        while dep.has_unfinished_requests():
            dep.step()
    return out


def decode_context(rows: list[TraceRow]) -> int:
    """The mean context (prompt + tokens generated so far) of a sequence in a decode step: every request's decode
    steps weighted by their number, sum(o * (p + o / 2)) / sum(o)."""
    outputs = sum(r.output_tokens for r in rows)
    return max(16, round(sum(r.output_tokens * (r.prompt_tokens + r.output_tokens / 2) for r in rows) / outputs))


def prefill_times(dep, tokenizer, lengths: list[int], repeats: int = 2) -> dict[int, float]:
    """Seconds from adding one prompt of each length alone to its first token (its prefill step)."""
    from elastic_hf.engine.sampling_params import SamplingParams

    out = {}
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for length in lengths:
        runs = []
        for r in range(repeats):
            prompt = wikitext_prompts(tokenizer, 1, length, length, seed=1000 + r)[0]
            dep.reset_prefix_cache()   # a cached prefix (the step table's prompts, a shorter probe) is no prefill
            started = time.perf_counter()
            _run_until_first_tokens(dep, {dep.add_request(None, prompt, params, instance=0)})
            runs.append(time.perf_counter() - started)
            while dep.has_unfinished_requests():
                dep.step()
        out[length] = min(runs)
    return out


def unloaded_latency(server: InProcessServer, tokenizer, prompt_tokens: int, output_tokens: int,
                     repeats: int = 3) -> tuple[float, float]:
    """Median TTFT and TPOT of one request at a time through the HTTP path of the replay."""
    ttfts, tpots = [], []
    for r in range(repeats):
        prompt = wikitext_prompts(tokenizer, 1, prompt_tokens, prompt_tokens, seed=2000 + r)[0]
        report = run_replay(server.base_url, [ReplayRequest(0.0, prompt, prompt_tokens, output_tokens)],
                            model=server.model.model_id, progress=False)
        result = report.results[0]
        if not result.ok:
            raise RuntimeError(f"unloaded probe request failed: {result.error}")
        ttfts.append(result.ttft_s)
        if result.tpot_s is not None:
            tpots.append(result.tpot_s)
    return statistics.median(ttfts), statistics.median(tpots) if tpots else float("nan")


def calibrate(args, bar, long_prompt: int, probe: tuple[int, int], context: int) -> tuple[Calibration, int]:
    """Loads a DP deployment with room for the step table at `context` tokens a sequence, measures it and its
    unloaded latency of a `probe` (prompt, output) request; returns the calibration and a TP1 worker's committed
    weight bytes."""
    from elastic_hf import ElasticModel

    bar.set_description("loading calibration (dp)")
    model = ElasticModel.from_pretrained(None, workers=2, topology=(1, 1), dtype=args.dtype,
                                         max_num_seqs=max(STEP_BATCHES),
                                         kv_cache_memory=calibration_blocks(context) * block_bytes_guess(args.dtype))
    try:
        dep = model.deployment
        block_bytes = model.memory_report()["workers"][0]["kv_block_bytes"]
        weights = measured_weights_bytes(model)
        model.generate([[1, 2, 3]] * 2, max_tokens=2)   # warm-up
        bar.set_description("calibration: decode steps")
        steps = decode_step_table(dep, model.tokenizer, STEP_BATCHES, context)
        bar.set_description("calibration: prefill")
        short, long_ = 32, max(64, long_prompt)
        pre = prefill_times(dep, model.tokenizer, [short, long_])
        per_token = max(0.0, (pre[long_] - pre[short]) / (long_ - short))
        fixed = max(0.0, pre[short] - per_token * short)
        bar.set_description("calibration: unloaded latency")
        server = InProcessServer(lambda: model)   # its steps run in the worker processes
        try:
            ttft, tpot = unloaded_latency(server, model.tokenizer, *probe)
        finally:
            server.stop()
        return Calibration(steps, fixed, per_token, ttft, tpot, block_bytes, probe, context), weights
    finally:
        model.close()


def calibration_blocks(context: int) -> int:
    """KV blocks per worker for the step table's largest batch at `context` tokens (plus the tokens it may decode
    and a block of rounding), and never fewer than CALIBRATION_KV_BLOCKS (the prefill probes)."""
    return max(CALIBRATION_KV_BLOCKS,
               max(STEP_BATCHES) * (-(-(context + CALIBRATION_DECODE_SLACK) // BLOCK_TOKENS) + 1))


def block_bytes_guess(dtype: str) -> int:
    """KV bytes of a block of the default model (30 layers x 3 KV heads x K/V x 16 tokens x 64 dims)."""
    from elastic_hf.config import DTYPES

    return 30 * 3 * 2 * 16 * 64 * (4 if DTYPES.get(dtype, dtype) == "float32" else 2)


def fluid_peak_demand(rows: list[TraceRow], cal: Calibration, prefill_util: float, block: int, dt: float = 0.25
                      ) -> tuple[float, float]:
    """(peak KV demand in tokens, its time in s) of `rows` (scaled arrival times) served by 2 DP instances with no
    KV limit, as a fluid: a request prefills for its prefill time on arrival, then decodes a token every step of
    the instances' current load (half the decoding requests each, slowed by the prefill share of their time), and
    holds its prompt, the tokens made so far and half a block of rounding. It has no queue and no preemption, so it
    is the demand the arrivals ask for, not what any deployment serves; the step time grows with the load, so a
    burst lasts longer than at the mean TPOT the rate was solved with."""
    pad = block / 2
    pending = sorted(rows, key=lambda r: r.arrival_s)
    active: list[list[float]] = []   # [prefill seconds left, tokens made, output tokens, prompt tokens]
    peak, peak_t, t, i = 0.0, 0.0, 0.0, 0
    while i < len(pending) or active:
        while i < len(pending) and pending[i].arrival_s <= t:
            r = pending[i]
            active.append([cal.prefill_s(r.prompt_tokens), 1.0, float(r.output_tokens), float(r.prompt_tokens)])
            i += 1
        decoding = sum(1 for a in active if a[0] <= 0)
        step = cal.step_at(max(1.0, decoding / 2)) / (1 - prefill_util)
        demand = sum(a[3] + a[1] + pad for a in active)
        if demand > peak:
            peak, peak_t = demand, t
        for a in active:
            if a[0] > 0:
                a[0] -= dt
            else:
                a[1] += dt / step
        active = [a for a in active if a[1] < a[2]]
        t += dt
    return peak, peak_t


def solve_rate(rows: list[TraceRow], cal: Calibration, capacity_tokens: int, util: float, block: int
               ) -> dict:
    """The mean arrival rate whose mean KV demand is `util` of `capacity_tokens` (module docstring), with what it
    assumes."""
    pad = block / 2   # demand is counted in blocks: half a block of rounding per request on average
    prefill = [cal.prefill_s(r.prompt_tokens) for r in rows]
    rate, concurrency = 1.0, 2.0
    for _ in range(100):
        rho = min(PREFILL_UTIL_CAP, rate / 2 * statistics.mean(prefill))   # prefill share of each instance's time
        tpot = cal.step_at(max(1.0, concurrency / 2)) / (1 - rho)
        kv_seconds = [p * (r.prompt_tokens + pad) + (r.output_tokens - 1) * tpot
                      * (r.prompt_tokens + r.output_tokens / 2 + pad) for r, p in zip(rows, prefill)]
        duration = [p + (r.output_tokens - 1) * tpot for r, p in zip(rows, prefill)]
        new_rate = util * capacity_tokens / statistics.mean(kv_seconds)
        concurrency = new_rate * statistics.mean(duration)
        if abs(new_rate - rate) < 1e-6 * rate:
            rate = new_rate
            break
        rate = new_rate
    return {"rate": rate, "concurrency": concurrency, "tpot_s": tpot, "prefill_util": rho,
            "kv_token_seconds": statistics.mean(kv_seconds), "duration_s": statistics.mean(duration)}


# ---------------------------------------------------------------- configs
def config_options(name: str, args, hysteresis: dict, cost_profile: str | None) -> dict:
    base = {"workers": 2, "kv_cache_memory": args.kv_cache_memory, "dtype": args.dtype, "seed": args.seed,
            "max_num_seqs": MAX_NUM_SEQS, "pipeline_batches": args.pipeline_batches}
    if name == "dp":
        return {**base, "topology": (1, 1), "overload": "off"}
    if name == "dp-routed":
        return {**base, "topology": (1, 1), "overload": "off", "rebalance_queues": False}
    if name == "pp":
        return {**base, "topology": "1x2", "overload": "off"}
    if name == "tp-merge":
        return {**base, "topology": (1, 1), "overload": {"mode": "tp-merge", **hysteresis}}
    if name == "morph":
        return {**base, "topology": (1, 1), "overload": {"mode": "morph", **hysteresis}, "morph": "default",
                "morph_options": {"precisions": ("w4",)}}
    drop = {"mode": "drop", **hysteresis, "exchange": "coordinated", "lookahead": True}
    if name == "+drop":
        drop.update(exchange="blocking", lookahead=False)
    elif name == "+exchange":
        drop.update(lookahead=False)
    elif name == "no-restore":
        # restore_below must be > 0, and an idle deployment's demand (0) is below any positive threshold: only a
        # restore hold longer than the run keeps it from restoring.
        drop.update(restore_below=0.01, restore_hold_steps=10 ** 9)
    elif name == "lifted":   # the exchange's cap lifted while requests queue for its memory
        drop.update(exchange_cpu_share_queued=1.0)
    return {**base, "topology": (1, 1), "overload": drop, "cost_profile": cost_profile}


@dataclass
class Run:
    name: str
    report: ReplayReport
    timeline: Timeline
    t0: float
    t_end: float
    counts: dict = field(default_factory=dict)
    topology: str = ""
    capacity_tokens: int = 0     # attached KV at the start (tokens)
    layouts: list = field(default_factory=list)   # what each drop / merge committed, e.g. [1x2:15/15]


def metric_total(registry, name: str) -> float:
    """Sum of every sample named `name` (all label values) in a prometheus registry."""
    return sum(s.value for metric in registry.collect() for s in metric.samples if s.name == name)


def bubble_parts(group) -> str:
    """Per stage, shares of its pipelined time: forwards, the idle gap before each step (the control plane between
    a step's output and the next batch), waiting for upstream activations, waiting for its sends, the rest (Python,
    the step's RPC)."""
    run = sorted(group, key=lambda r: r.counts["bubble"])[len(group) // 2]
    out = []
    for stage in (0, 1):
        c = {part: run.counts[f"stage{stage}_{part}"] for part in PIPELINE_PARTS}
        if c["wall_s"] <= 0:
            continue
        rest = c["wall_s"] - c["busy_s"] - c["gap_s"] - c["recv_s"] - c["flush_s"]
        shares = " / ".join(f"{100 * v / c['wall_s']:.1f}" for v in (c["busy_s"], c["gap_s"], c["recv_s"],
                                                                     c["flush_s"], rest))
        out.append(f"stage {stage} {c['wall_s']:.1f} s: {shares} %")
    return "; ".join(out) + " (busy / gap / recv / flush / rest)"


def counters(model) -> dict:
    dep = model.deployment
    registry = dep.metrics.registry
    m = dep.deployment_metrics
    return {"preemptions": metric_total(registry, "elastic_hf_preemptions_total"),
            "exchange_bytes": metric_total(registry, "elastic_hf_kv_exchange_bytes_total"),
            "exchange_s": metric_total(registry, "elastic_hf_kv_exchange_seconds_total"),
            "reshape_kv_bytes": metric_total(registry, "elastic_hf_reshape_kv_moved_bytes_total"),
            "morph_swaps": metric_total(registry, "elastic_hf_morph_swaps_total"),
            "busy_s": m.pipeline_busy_s, "wall_s": m.pipeline_wall_s,
            **{f"stage{stage}_{part}": m.pipeline_stage_s.get(stage, {}).get(part, 0.0)
               for stage in (0, 1) for part in PIPELINE_PARTS},
            "reshapes": len(dep.reshapes), "history": len(dep.overload.history)}


def run_config(name: str, args, requests, slo, hysteresis, cost_profile, bar) -> Run:
    from elastic_hf import ElasticModel

    bar.set_description(f"loading {name}")
    options = config_options(name, args, hysteresis, cost_profile)
    model = ElasticModel.from_pretrained(None, **options)
    try:
        dep = model.deployment
        if name == "pp":
            # The honest control holds what a drop's group holds: the layer split with the most KV (its first stage
            # holds no vocabulary table), the one stage_split picks under a demand no split holds.
            split = dep.overload.group_shape(2, sys.maxsize)
            if dep.topology.instance_keys()[0][1] != split:
                model.reshape([str(split)])
        model.generate([[1, 2, 3]] * 2, max_tokens=2)   # warm-up: first forwards, native kernels
        before = counters(model)
        capacity = sum(i.engine.scheduler.kv.num_total for i in dep.instances) * dep.config.block_size
        topology = str(dep.topology)
        timeline = Timeline(dep)
        server = InProcessServer(lambda: model)   # its steps run in the worker processes
        try:
            bar.set_description(f"replay {name}")
            t0 = time.perf_counter()
            report = run_replay(server.base_url, requests, model=model.model_id, ttft_slo_s=slo[0],
                                tpot_slo_s=slo[1])
            t_end = time.perf_counter()
            if name != "no-restore" and dep.overload.arbiter.active in ("drop", "tp-merge"):
                bar.set_description(f"{name}: waiting for the restore")
                deadline = time.monotonic() + args.restore_wait
                while dep.overload.arbiter.active in ("drop", "tp-merge") and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            server.stop()
        after = counters(model)
        history = list(dep.overload.history)[before["history"]:]
        committed = [h for h in history if h.get("outcome") == "committed"]
        counts = {key: after[key] - before[key] for key in after if key != "history"}
        counts.update(drops=sum(h["event"] == "drop" for h in committed),
                      restores=sum(h["event"] == "restore" for h in committed),
                      merges=sum(h["event"] == "tp-merge" for h in committed),
                      refused=sum(h.get("event") in ("drop", "tp-merge", "restore")
                                  and h.get("outcome") != "committed" for h in history),
                      reshape_s=sum(r.seconds for r in dep.reshapes[before["reshapes"]:] if r.committed),
                      reshape_preempted=sum(len(r.preempted) for r in dep.reshapes[before["reshapes"]:]),
                      final_topology=str(dep.topology))
        layouts = [h["new"] for h in committed if h["event"] in ("drop", "tp-merge")]
        wall = counts["wall_s"]
        counts["bubble"] = 1 - counts["busy_s"] / wall if wall > 0 else float("nan")
        return Run(name, report, timeline, t0, t_end, counts, topology, capacity, layouts)
    finally:
        model.close()
        del model
        gc.collect()


# ---------------------------------------------------------------- output
def plot(path: str, runs: list[Run], slo_ttft: float, dp_capacity_tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"drop": "tab:red", "tp-merge": "tab:orange", "restore": "tab:green", "exchange_done": "tab:gray"}
    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 1.0 + 2.2 * len(runs)), sharex=True, sharey=True,
                             squeeze=False)
    kv_top = max(2.0, 1.1 * max((r[1] / dp_capacity_tokens for run in runs for r in run.timeline.rows), default=1))
    for ax, run in zip(axes[:, 0], runs):
        ok = [r for r in run.report.results if r.ok]
        ax.scatter([r.arrival_s for r in ok], [r.ttft_s for r in ok], s=10, color="tab:blue", label="TTFT")
        failed = [r.arrival_s for r in run.report.results if not r.ok]
        if failed:
            ax.scatter(failed, [0] * len(failed), marker="x", color="black", label="failed")
        ax.axhline(slo_ttft, color="tab:blue", linestyle=":", linewidth=0.8, label="TTFT SLO")
        ax.set_ylabel(f"{run.name}\nTTFT (s)")
        ax2 = ax.twinx()
        t = [r[0] - run.t0 for r in run.timeline.rows]
        ax2.plot(t, [r[1] / dp_capacity_tokens for r in run.timeline.rows], color="tab:purple", linewidth=0.7,
                 alpha=0.7, label="KV demand")
        ax2.step(t, [r[2] / dp_capacity_tokens for r in run.timeline.rows], where="post", color="black",
                 linewidth=0.7, alpha=0.7, label="KV capacity")
        ax2.set_ylim(0, kv_top)
        caps = [r[2] for r in run.timeline.rows] or [run.capacity_tokens]
        ax.set_title(f"{run.name}: {run.topology} -> {run.counts['final_topology']}, KV capacity {min(caps)}.."
                     f"{max(caps)} tokens (DP: {dp_capacity_tokens})", fontsize=8, loc="right")
        ax2.set_ylabel("KV / DP capacity", fontsize=8)
        for when, entry in run.timeline.events:
            if entry.get("outcome", "committed") == "committed" and entry["event"] in colors:
                ax.axvline(when - run.t0, color=colors[entry["event"]], linestyle="--", linewidth=1)
        if ax is axes[0, 0]:
            handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
            handles += [plt.Line2D([], [], color=c, linestyle="--", label=e) for e, c in colors.items()]
            fig.legend(handles=handles, fontsize=7, loc="upper center", ncol=len(handles))
    axes[-1, 0].set_xlabel("arrival time since replay start (s); events at the step boundary they committed at")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (1.0 + 2.2 * len(runs))))
    fig.savefig(path, dpi=110)


def fmt(value: float, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def print_results(runs: dict[str, list[Run]], slo: tuple[float, float]) -> None:
    """Medians over the runs ([min-max] for the P99 TTFT and the P50 TPOT)."""
    def med(name, f):
        return median([f(run) for run in runs[name]])

    print(f"\n{'config':<11}{'TTFT p50':>9}{'TTFT p99 [spread]':>24}{'TPOT p50 [spread]':>27}{'p99':>8}{'SLO':>7}"
          f"{'tok/s':>7}{'drops':>6}{'rest.':>6}{'merge':>6}{'preem':>6}{'xchg MiB':>9}{'xchg s':>7}{'reshp s':>8}"
          f"{'bubble':>7}  topology")
    for name, group in runs.items():
        c0 = group[0].counts
        print(f"{name:<11}{fmt(med(name, lambda r: r.report.ttft(50))):>9}"
              f"{median_spread([r.report.ttft(99) for r in group]):>24}"
              f"{median_spread([r.report.tpot(50) for r in group], 4):>27}"
              f"{fmt(med(name, lambda r: r.report.tpot(99)), 4):>8}"
              f"{100 * med(name, lambda r: r.report.slo_attainment):>6.1f}%"
              f"{med(name, lambda r: r.report.output_throughput):>7.1f}"
              + "".join(f"{med(name, lambda r, k=k: r.counts[k]):>6.0f}"
                        for k in ("drops", "restores", "merges", "preemptions"))
              + f"{med(name, lambda r: r.counts['exchange_bytes']) / 2 ** 20:>9.1f}"
                f"{med(name, lambda r: r.counts['exchange_s']):>7.2f}{med(name, lambda r: r.counts['reshape_s']):>8.2f}"
                f"{fmt(med(name, lambda r: r.counts['bubble'])):>7}  {group[0].topology}->{c0['final_topology']}")
    print(f"medians over {len(next(iter(runs.values())))} run(s) per config, alternating; SLO: TTFT <= {slo[0]:.3f} s "
          f"and TPOT <= {slo[1]:.4f} s; xchg: coordinated KV exchange bytes / seconds (a blocking exchange moves its "
          f"KV inside the reshape: reshp s); bubble: 1 - busy / wall over every stage of every pipelined step ('-': "
          f"never pipelined)")
    for name, group in runs.items():
        extra = []
        for run in group:
            c = run.counts
            bits = []
            if c["refused"]:
                bits.append(f"{c['refused']} refused/rolled back")
            if run.layouts:
                bits.append("to " + ", ".join(run.layouts))
            if c["reshape_kv_bytes"]:
                bits.append(f"reshape KV moved {c['reshape_kv_bytes'] / 2 ** 20:.1f} MiB")
            if c["reshape_preempted"]:
                bits.append(f"{c['reshape_preempted']} requests preempted by reshapes")
            if c["morph_swaps"]:
                bits.append(f"{int(c['morph_swaps'])} morph layer swaps")
            failed = len(run.report.results) - len(run.report.ok)
            if failed:
                bits.append(f"{failed} failed requests")
            extra.append(", ".join(bits) or "-")
        if any(e != "-" for e in extra):
            print(f"  {name}: " + " | ".join(extra))
    ablation = [(label, name) for label, name in (("+drop", "+drop"), ("+exchange", "+exchange"),
                                                   ("+lookahead", "kunserve"), ("no-restore", "no-restore"),
                                                   ("lifted", "lifted"))
                if name in runs]
    if len(ablation) > 1:
        print("\nablation (KunServe §5.3, §5.5): blocking exchange -> coordinated exchange -> lookahead "
              "micro-batches (= kunserve) -> without restore; lifted: the exchange uncapped while requests queue")
        for label, name in ablation:
            group = runs[name]
            print(f"  {label:<11} TTFT p99 {median_spread([r.report.ttft(99) for r in group])}  TPOT p50 "
                  f"{median_spread([r.report.tpot(50) for r in group], 4)}  SLO "
                  f"{100 * med(name, lambda r: r.report.slo_attainment):.1f}%  bubble "
                  f"{fmt(med(name, lambda r: r.counts['bubble']))}")
    for name, group in runs.items():
        if med(name, lambda r: r.counts["stage0_wall_s"]) > 0:
            print(f"  {name}: where the pipelined steps' time went (median run), {bubble_parts(group)}")
    for name, group in runs.items():
        spans = [restore_tpot(run) for run in group]
        if any(n for _, _, n in spans):
            print(f"  {name}: P99 TPOT of requests decoding across a restore / of the others, per run: "
                  + ", ".join(f"{a:.4f}/{b:.4f} s ({n} requests, {a / b:.2f}x)" for a, b, n in spans if n))
    for base in ("dp", "pp", "dp-routed"):
        if base not in runs:
            continue
        print(f"\nratios vs {base}, per run then median [min-max] (P99 TTFT gain = {base} / config; P50 TPOT gain = "
              f"{base} / config; throughput = config / {base}):")
        for name in runs:
            print(f"  {name:<11} P99 TTFT gain {median_spread(paired(runs, base, name, ttft99_gain)):>20}   "
                  f"P50 TPOT gain {median_spread(paired(runs, base, name, tpot50_gain)):>20}   throughput "
                  f"{median_spread(paired(runs, name, base, throughput_ratio))}")


def restore_tpot(run: Run) -> tuple[float, float, int]:
    """(P99 TPOT of the requests decoding across a restore, P99 TPOT of the others, how many spanned one): how much
    the stop-the-world restore costs the requests it interrupts (a request's TPOT is its mean gap)."""
    restores = [when - run.t0 for when, entry in run.timeline.events
                if entry.get("event") == "restore" and entry.get("outcome") == "committed"]
    spanning, steady = [], []
    for r in run.report.results:
        if not r.ok or r.tpot_s is None or r.latency_s is None:
            continue
        first, last = r.arrival_s + r.ttft_s, r.arrival_s + r.latency_s
        (spanning if any(first <= t <= last for t in restores) else steady).append(r.tpot_s)
    return percentile(spanning, 99), percentile(steady, 99), len(spanning)


def ttft99_gain(base: Run, other: Run) -> float:
    return base.report.ttft(99) / max(other.report.ttft(99), 1e-9)


def tpot50_gain(base: Run, other: Run) -> float:
    return base.report.tpot(50) / max(other.report.tpot(50), 1e-9)


def throughput_ratio(a: Run, b: Run) -> float:
    return a.report.output_throughput / max(b.report.output_throughput, 1e-9)


def paired(runs: dict[str, list[Run]], a: str, b: str, f) -> list[float]:
    """f(run of a, run of b) for each run index (the configs alternate, so run i of each shares the machine's
    state)."""
    return [f(x, y) for x, y in zip(runs[a], runs[b])]


def print_result_lines(runs: dict[str, list[Run]], suffix: str) -> None:
    def result(name, values):
        print(f"RESULT {name}_{suffix} {median(values):.4g}")

    if "dp" in runs and "kunserve" in runs:
        result("kunserve_p99_ttft_gain_vs_dp", paired(runs, "dp", "kunserve", ttft99_gain))
        result("kunserve_p50_tpot_gain_vs_dp", paired(runs, "dp", "kunserve", tpot50_gain))
    if "pp" in runs and "kunserve" in runs:
        result("kunserve_p99_ttft_gain_vs_static_pp", paired(runs, "pp", "kunserve", ttft99_gain))
        result("kunserve_p50_tpot_gain_vs_static_pp", paired(runs, "pp", "kunserve", tpot50_gain))
    if "kunserve" in runs:
        result("lookahead_bubble_ratio", [r.counts["bubble"] for r in runs["kunserve"]])
    if "+exchange" in runs:
        result("token_count_bubble_ratio", [r.counts["bubble"] for r in runs["+exchange"]])
    for name, group in runs.items():
        result(f"{name.replace('+', 'plus_').replace('-', '_')}_p99_ttft_s", [r.report.ttft(99) for r in group])


def median_run(group: list[Run]) -> Run:
    return sorted(group, key=lambda r: r.report.ttft(99))[len(group) // 2]


def main(argv=None) -> int:
    from elastic_hf.units import parse_memory_budget

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--num-requests", default="auto",
                    help="consecutive trace rows around the largest burst; 'auto': per weight share the smallest of "
                         f"{', '.join(map(str, AUTO_WINDOW_SIZES))} whose burst reaches --burst-peak")
    ap.add_argument("--burst-peak", type=float, default=0.95,
                    help="with --num-requests auto: the least fluid-estimated peak KV demand / DP capacity")
    add_weight_share_arg(ap)
    ap.add_argument("--kv-cache-memory", default=None,
                    help="KV bytes per worker as a DP instance for every config, instead of --weight-share")
    ap.add_argument("--runs", type=int, default=3, help="replays per config and regime, alternating configs")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                    help=f"comma-separated subset of {', '.join(CONFIGS)} (+lookahead = kunserve)")
    ap.add_argument("--cost-profile", default=None,
                    help="`elastic-hf profile-cost` JSON for the drop configs (default: profile a small grid now "
                         "into a temp dir)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt windows and the engines")
    ap.add_argument("--plot", default=str(result_path("param_drop.png")),
                    help="TTFT over arrival time per config, median run, one file per regime ('' for none)")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    ap.add_argument("--prompt-scale", type=float, default=0.25, help="factor on trace prompt tokens")
    ap.add_argument("--output-scale", type=float, default=32.0, help="factor on trace output tokens")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="prompt cap (shrunk to fit an instance)")
    ap.add_argument("--max-output-tokens", type=int, default=768, help="output cap (shrunk to fit an instance)")
    ap.add_argument("--target-util", type=float, default=0.55, help="mean KV demand / DP capacity (KunServe: < 60%%)")
    ap.add_argument("--slo-scale", type=float, default=5.0, help="SLO = this x the DP's unloaded TTFT / TPOT")
    ap.add_argument("--plan-only", action="store_true",
                    help="calibrate, print each regime's workload plan (rate, lengths, burst) and exit")
    ap.add_argument("--pipeline-batches", type=int, default=None,
                    help="batches a pipelined instance keeps in flight (EngineConfig.pipeline_batches; default: one "
                         "per stage)")
    ap.add_argument("--restore-wait", type=float, default=30.0,
                    help="seconds to wait after the replay for a drop / merge still in effect to restore")
    args = ap.parse_args(argv)
    try:
        shares = parse_weight_shares(args.weight_share)
    except ValueError as exc:
        ap.error(str(exc))
    if args.runs < 1:
        ap.error(f"--runs must be >= 1, got {args.runs}")
    configs = []
    for name in (c.strip() for c in args.configs.split(",") if c.strip()):
        name = ALIASES.get(name, name)
        if name not in CONFIGS:
            ap.error(f"unknown config {name!r}; choose from {', '.join(CONFIGS)} (+lookahead = kunserve)")
        if name not in configs:
            configs.append(name)
    torch.set_num_threads(1)   # the workers compute; this process tokenizes, serves HTTP and schedules

    if args.num_requests == "auto":
        sizes = list(AUTO_WINDOW_SIZES)
    else:
        try:
            sizes = [int(args.num_requests)]
        except ValueError:
            ap.error(f"--num-requests must be an integer or 'auto', got {args.num_requests!r}")
    all_rows = load_trace(None)
    try:
        windows = [find_burst_window(all_rows, n) for n in sizes]
    except ValueError as exc:
        ap.error(str(exc))
    print(f"machine: {machine_description()}, load average {os.getloadavg()[0]:.1f} at start")
    for window in windows:
        print(f"window: {TRACE_NAME} rows {window.start}..{window.start + len(window.rows) - 1} "
              f"({window.rows[-1].arrival_s:.1f} s of trace): mean {window.mean_rate:.2f} req/s, peak over "
              f"{window.sub} arrivals {window.peak_rate:.1f} req/s at row +{window.peak_offset} "
              f"(burst factor {window.burst_factor:.1f}x the mean)")

    regimes = [None] if args.kv_cache_memory is not None else shares
    phases = 1 + (0 if args.plan_only else len(regimes) * len(configs) * args.runs)
    want_profile = args.cost_profile is None and not args.plan_only and any(c in DROP_CONFIGS for c in configs)
    with tqdm(total=phases + want_profile, desc="param_drop", unit="phase") as bar:
        cost_profile = profile_cost(args, bar) if want_profile else args.cost_profile
        if not want_profile and cost_profile is not None:
            tqdm.write(f"cost profile: {cost_profile} (given)")
        unbound = TraceScale(1.0, args.prompt_scale, args.output_scale, args.max_prompt_tokens,
                             args.max_output_tokens)
        # the calibration's step table, probe and SLO come from the smallest window (one calibration for all)
        unbound_rows = scale_trace(windows[0].rows, unbound)
        probe = (int(statistics.median(r.prompt_tokens for r in unbound_rows)),
                 max(16, int(statistics.median(r.output_tokens for r in unbound_rows))))
        context = decode_context(unbound_rows)
        cal, weights = calibrate(args, bar, args.max_prompt_tokens, probe, context)
        bar.update()
        print_calibration(cal, weights)
        slo = (args.slo_scale * cal.unloaded_ttft_s, args.slo_scale * cal.unloaded_tpot_s)
        tqdm.write(f"SLO ({args.slo_scale:g}x the DP's unloaded latency of a {cal.probe[0]}-token prompt, "
                   f"{cal.probe[1]} outputs: TTFT {cal.unloaded_ttft_s:.3f} s, TPOT {cal.unloaded_tpot_s:.4f} s): "
                   f"TTFT <= {slo[0]:.3f} s, TPOT <= {slo[1]:.4f} s")
        outcomes = []
        for share in regimes:
            if share is None:
                kv = parse_memory_budget(args.kv_cache_memory, None)
                share = weights / (weights + kv)
            else:
                kv = kv_bytes_for_share(weights, share)
            regime_args = argparse.Namespace(**{**vars(args), "kv_cache_memory": kv})
            window = (windows[0] if len(windows) == 1 else
                      choose_window(regime_args, windows, cal, kv // cal.block_bytes))
            requests, capacity_tokens, hysteresis = plan_regime(regime_args, window, cal, weights, share)
            if args.plan_only:
                continue
            runs: dict[str, list[Run]] = {name: [] for name in configs}
            for r in range(args.runs):
                for name in configs:
                    run = run_config(name, regime_args, requests, slo, hysteresis, cost_profile, bar)
                    runs[name].append(run)
                    c = run.counts
                    # the rate was solved for the steady demand while requests arrive; both spans miss it a little
                    # (the arrival span starts empty, the span to the last reply adds the drain), so both print
                    arrivals = run.timeline.mean_demand(run.t0, run.t0 + requests[-1].arrival_s)
                    demand = run.timeline.mean_demand(run.t0, run.t_end)
                    tqdm.write(f"[weight share {share:.2f}, run {r + 1}/{args.runs}, {name}] "
                               f"{run.report.summary().splitlines()[2]}; TPOT P50 {run.report.tpot(50):.4f} s; "
                               f"drops {c['drops']} restores "
                               f"{c['restores']} merges {c['merges']} preemptions {int(c['preemptions'])}; KV "
                               f"capacity at start {run.capacity_tokens} tokens; mean KV demand "
                               f"{100 * arrivals / capacity_tokens:.0f} % of the DP capacity while requests arrive "
                               f"({100 * demand / capacity_tokens:.0f} % to the last reply)")
                    bar.update()
            outcomes.append((share, runs, capacity_tokens))

    for share, runs, capacity_tokens in outcomes:
        print(f"\n=== weight share {share:.2f} (weights {weights / 2 ** 20:.0f} MiB + KV "
              f"{kv_bytes_for_share(weights, share) / 2 ** 20:.0f} MiB per worker as DP) ===")
        print_results(runs, slo)
        if args.plot and runs:
            path = Path(args.plot)
            path = path.with_name(f"{path.stem}_{share_label(share)}{path.suffix}")
            plot(str(path), [median_run(group) for group in runs.values()], slo[0], capacity_tokens)
            print(f"plot (median run of each config): {path}")
    for share, runs, _ in outcomes:
        print_result_lines(runs, share_label(share))
    return 0


def profile_cost(args, bar) -> str:
    """`elastic-hf profile-cost --grid small` into a temp dir (the drop configs' layer split and lookahead)."""
    bar.set_description("profile-cost (small grid)")
    out_dir = tempfile.mkdtemp(prefix="param_drop_")
    path = str(Path(out_dir) / "cost-profile.json")
    threads = max(1, (os.cpu_count() or 2) // 2)
    exe = Path(sys.executable).with_name("elastic-hf")
    cmd = [str(exe), "profile-cost", "--grid", "small", "--threads", str(threads), "--dtype", args.dtype,
           "--out", path, "--no-progress"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        raise SystemExit(f"`{' '.join(cmd)}` failed with exit code {done.returncode}")
    tqdm.write(f"cost profile: {path} ({' '.join(cmd[1:])})\n  " + "\n  ".join(done.stdout.strip().splitlines()[-3:]))
    bar.update()
    return path


def print_calibration(cal: Calibration, weights: int) -> None:
    table = "  ".join(f"b={b}: {1e3 * s:.1f}" for b, s in cal.step_s.items())
    flat = cal.step_s[max(cal.step_s)] / cal.step_s[min(cal.step_s)]
    knee = next((b for b, s in cal.step_s.items() if s > 1.5 * cal.step_s[min(cal.step_s)]), None)
    verdict = ("memory-bound over the whole range (step time roughly flat in batch)" if knee is None else
               f"memory-bound up to b~{knee // 2 if knee > 1 else 1}, compute-bound from b={knee} (step time "
               f"grows with batch)")
    tqdm.write(f"DP decode step (ms, per instance with every instance at b sequences of {cal.context} tokens, "
               f"through the engine): {table}; b={max(cal.step_s)} costs "
               f"{flat:.2f}x b=1 -> {verdict}")
    tqdm.write(f"DP prefill alone: {1e3 * cal.prefill_fixed_s:.0f} ms + {1e3 * cal.prefill_per_token_s:.2f} ms "
               f"per prompt token; KV block {cal.block_bytes} B; weights {weights / 2 ** 20:.1f} MiB per TP1 worker")


def scaled_window(args, window: Window, cal: Calibration, instance_blocks: int
                  ) -> tuple[list[TraceRow], TraceScale, dict]:
    """The window's rows at the lengths and the mean rate of one memory regime (module docstring), with the scale
    and the rate solution."""
    cap_p, cap_o = length_caps(args, instance_blocks * BLOCK_TOKENS)
    rows = scale_trace(window.rows, TraceScale(1.0, args.prompt_scale, args.output_scale, cap_p, cap_o))
    sol = solve_rate(rows, cal, 2 * instance_blocks * BLOCK_TOKENS, args.target_util, BLOCK_TOKENS)
    scale = TraceScale(time_scale_for_rate(rows, sol["rate"]), args.prompt_scale, args.output_scale, cap_p, cap_o)
    return scale_trace(window.rows, scale), scale, sol


def choose_window(args, windows: list[Window], cal: Calibration, instance_blocks: int) -> Window:
    """The smallest of `windows` (ascending sizes) whose burst asks for at least --burst-peak of the DP capacity
    by the fluid estimate at the solved rate, else the largest (with a warning): a burst that stays below the
    capacity overflows nothing, and the drop configs then serve exactly as DP."""
    capacity = 2 * instance_blocks * BLOCK_TOKENS
    for window in windows:
        rows, _, sol = scaled_window(args, window, cal, instance_blocks)
        peak, when = fluid_peak_demand(rows, cal, sol["prefill_util"], BLOCK_TOKENS)
        tqdm.write(f"window of {len(rows)} rows from {window.start}: {sol['rate']:.3f} req/s over "
                   f"{rows[-1].arrival_s:.0f} s, burst peak {100 * peak / capacity:.0f} % of the DP capacity at "
                   f"{when:.0f} s (fluid estimate; --burst-peak {100 * args.burst_peak:.0f} %)")
        if peak >= args.burst_peak * capacity:
            return window
    tqdm.write(f"WARNING: no window of {', '.join(str(len(w.rows)) for w in windows)} rows has a burst above "
               f"{100 * args.burst_peak:.0f} % of the DP capacity: the largest is replayed, its burst may overflow "
               f"nothing")
    return windows[-1]


def plan_regime(args, window: Window, cal: Calibration, weights: int, share: float):
    """The requests, DP capacity (tokens) and hysteresis of one memory regime (module docstring)."""
    from transformers import AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    block = BLOCK_TOKENS
    instance_blocks = args.kv_cache_memory // cal.block_bytes
    capacity_tokens = 2 * instance_blocks * block
    rows, scale, sol = scaled_window(args, window, cal, instance_blocks)
    peak, peak_at = fluid_peak_demand(rows, cal, sol["prefill_util"], block)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(None).checkpoint_dir)
    requests = build_requests(rows, tokenizer, seed=args.seed)
    mean_gap = rows[-1].arrival_s / max(len(rows) - 1, 1)
    step = cal.step_at(max(1.0, sol["concurrency"] / 2)) / (1 - sol["prefill_util"])
    hysteresis = {"hold_steps": 2, "restore_below": 0.5,
                  "restore_hold_steps": max(8, round(RESTORE_HOLD_ARRIVALS * mean_gap / step)),
                  "cooldown_steps": max(16, round(COOLDOWN_ARRIVALS * mean_gap / step))}
    burst = rows[window.peak_offset:window.peak_offset + window.sub]
    burst_tokens = sum(r.prompt_tokens + r.output_tokens for r in burst)
    tqdm.write(f"\nweight share {share:.2f}, window rows {window.start}..{window.start + len(rows) - 1}: KV "
               f"{args.kv_cache_memory / 2 ** 20:.1f} MiB per worker beside "
               f"{weights / 2 ** 20:.1f} MiB of weights -> DP capacity {instance_blocks} blocks per instance = "
               f"{instance_blocks * block} tokens, {capacity_tokens} tokens over both")
    tqdm.write(f"lengths: {scale.describe()}: prompt mean {statistics.mean(r.prompt_tokens for r in rows):.0f}, "
               f"output mean {statistics.mean(r.output_tokens for r in rows):.1f}; every request <= "
               f"{int(REQUEST_KV_SHARE * 100)} % of one instance")
    tqdm.write(f"time scale x{scale.time_scale:.3g}: mean {sol['rate']:.3f} req/s over {rows[-1].arrival_s:.1f} s "
               f"-> target mean KV demand {100 * args.target_util:.0f} % of the DP capacity (est. concurrency "
               f"{sol['concurrency']:.1f}, TPOT {1e3 * sol['tpot_s']:.0f} ms, prefill utilisation "
               f"{100 * sol['prefill_util']:.0f} %, {sol['kv_token_seconds']:.0f} KV token-s per request, a request "
               f"lasts ~{sol['duration_s']:.1f} s unloaded); the peak brings {len(burst)} requests holding up to "
               f"{burst_tokens} KV tokens ({100 * burst_tokens / capacity_tokens:.0f} % of the DP capacity) "
               f"within {burst[-1].arrival_s - burst[0].arrival_s:.1f} s; fluid estimate of the peak KV demand "
               f"{100 * peak / capacity_tokens:.0f} % of the DP capacity, {peak_at:.0f} s in")
    if sol["prefill_util"] >= PREFILL_UTIL_CAP - 1e-9:
        tqdm.write(f"WARNING: this regime is compute-bound on this machine: holding {100 * args.target_util:.0f} % of "
                   f"the DP KV with these request lengths needs prefill at >= {100 * PREFILL_UTIL_CAP:.0f} % of the "
                   f"instances' time, so the queue grows for compute, not KV (a drop frees memory, not compute). "
                   f"Longer outputs per prompt token (--output-scale, --max-output-tokens) hold more KV per unit of "
                   f"compute.")
    tqdm.write(f"hysteresis (drop / merge configs): {hysteresis} (decode step at the expected load "
               f"~{1e3 * step:.0f} ms, mean inter-arrival {mean_gap:.2f} s)")
    return requests, capacity_tokens, hysteresis


if __name__ == "__main__":
    sys.exit(main())
