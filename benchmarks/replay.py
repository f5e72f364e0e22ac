"""Open-loop replay of an Azure LLM 2023 trace (code or conversation) against an OpenAI-compatible server.

Requests are sent at their (scaled) trace arrival times whether or not earlier ones finished, so queueing shows
up in TTFT as it would in production. The trace was recorded on large GPU clusters; token counts and the time
axis are scaled to fit this machine and the factors are printed with every result. Prompts are windows of
wikitext token ids with exactly the requested length; `ignore_eos` makes every completion as long as the trace
says.

    python benchmarks/replay.py --start-server [--num-requests 48 --rate 0.5]      # starts elastic-hf serve
    python benchmarks/replay.py --url http://127.0.0.1:8000 [--api-key K]            # a running server
    python benchmarks/replay.py --start-server --trace conv                          # the conversation trace

The two traces are different kinds of work (first 48 rows): the code service sends long prompts for short answers
(2,557 prompt / 20 output tokens on average; replayed at prompts x1/16: prefill-heavy), the conversation service
shorter prompts for longer answers (722 / 56 within the 64-token cap; replayed at prompts x1/4: decode-heavy).

Other benchmarks reuse it:
    from replay import load_trace, scale_trace, build_requests, run_replay
    report = run_replay(base_url, requests, ttft_slo_s=2.0, tpot_slo_s=0.2)
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DATA_DIR, PROJECT_ROOT, machine_description, wikitext_text  # noqa: E402

# The traces in benchmarks/data, by name, with the factor on prompt tokens that fits each to this machine by default
TRACES = {"code": ("azure-llm-2023-code.csv", 1 / 16), "conv": ("azure-llm-2023-conv.csv", 0.25)}
TRACE_NAME = TRACES["code"][0]   # the default trace


def _named(trace: str | os.PathLike | None) -> tuple[str, float] | None:
    """(file, default prompt factor) of a trace given by name (None: the code trace); None for a path."""
    return TRACES["code"] if trace is None else TRACES.get(str(trace))


def trace_path(trace: str | os.PathLike | None) -> Path:
    """A trace's file: None for the default (code), a name of TRACES, or a path to a CSV of the same columns."""
    named = _named(trace)
    return DATA_DIR / named[0] if named else Path(trace)


def prompt_scale_for(trace: str | os.PathLike | None, given: float | None = None) -> float:
    """The factor on prompt tokens: `given` (a --prompt-scale flag) when set, else the named trace's default (a CSV
    path gets the code trace's)."""
    if given is not None:
        return given
    return (_named(trace) or TRACES["code"])[1]


# ---------------------------------------------------------------- trace
@dataclass(slots=True)
class TraceRow:
    arrival_s: float        # since the first row of the trace
    prompt_tokens: int
    output_tokens: int


@dataclass(slots=True)
class TraceScale:
    time_scale: float       # replay inter-arrival = trace inter-arrival x time_scale
    prompt_scale: float     # replay prompt tokens = trace ContextTokens x prompt_scale (clamped)
    output_scale: float     # replay output tokens = trace GeneratedTokens x output_scale (clamped)
    max_prompt_tokens: int
    max_output_tokens: int

    def describe(self) -> str:
        return (f"time x{self.time_scale:.3g}, prompt tokens x{self.prompt_scale:.3g} (cap {self.max_prompt_tokens}), "
                f"output tokens x{self.output_scale:.3g} (cap {self.max_output_tokens})")


def load_trace(path: str | os.PathLike | None = None, *, start: int = 0, num_requests: int | None = None
               ) -> list[TraceRow]:
    """Rows [start, start + num_requests) of the trace (a name of TRACES or a path; None: the code trace),
    arrival times relative to the first of them."""
    path = trace_path(path)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    rows = rows[start:start + num_requests if num_requests else None]
    if not rows:
        raise ValueError(f"no trace rows in [{start}, {start + (num_requests or 0)}) of {path}")
    stamps = [datetime.fromisoformat(r["TIMESTAMP"][:26]) for r in rows]
    t0 = stamps[0]
    return [TraceRow((t - t0).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
            for t, r in zip(stamps, rows)]


def scale_trace(rows: list[TraceRow], scale: TraceScale) -> list[TraceRow]:
    out = []
    for row in rows:
        prompt = min(scale.max_prompt_tokens, max(1, round(row.prompt_tokens * scale.prompt_scale)))
        output = min(scale.max_output_tokens, max(1, round(row.output_tokens * scale.output_scale)))
        out.append(TraceRow(row.arrival_s * scale.time_scale, prompt, output))
    return out


def time_scale_for_rate(rows: list[TraceRow], rate: float) -> float:
    """Factor that makes the mean arrival rate of `rows` equal `rate` requests/s."""
    span = rows[-1].arrival_s - rows[0].arrival_s
    if len(rows) < 2 or span <= 0:
        return 1.0
    return (len(rows) - 1) / rate / span


# ---------------------------------------------------------------- requests
@dataclass(slots=True)
class ReplayRequest:
    arrival_s: float
    prompt: list[int] | str
    prompt_tokens: int
    max_tokens: int


def build_requests(rows: list[TraceRow], tokenizer, *, seed: int = 0, as_text: bool = False) -> list[ReplayRequest]:
    """One request per row: a window of wikitext token ids of exactly the row's prompt length, at a random
    offset so that requests share no prefix."""
    text = wikitext_text()
    need = max(r.prompt_tokens for r in rows) + 1
    ids = tokenizer.encode(text[:max(400_000, need * 8)], add_special_tokens=False)
    if len(ids) <= need:
        raise ValueError(f"wikitext gives {len(ids)} tokens; the longest prompt needs {need}")
    rng = random.Random(seed)
    requests = []
    for row in rows:
        begin = rng.randint(0, len(ids) - row.prompt_tokens - 1)
        window = ids[begin:begin + row.prompt_tokens]
        prompt = tokenizer.decode(window) if as_text else window
        requests.append(ReplayRequest(row.arrival_s, prompt, row.prompt_tokens, row.output_tokens))
    return requests


# ---------------------------------------------------------------- results
@dataclass(slots=True)
class RequestResult:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float | None = None      # send -> first token
    tpot_s: float | None = None      # mean time per output token after the first
    latency_s: float | None = None   # send -> last byte
    error: str | None = None
    # for joining with the server's own timeline (elastic-hf serve --timeline): the response id and the wall-clock
    # times (time.time(), as the server logs them) of sending and of the first token
    response_id: str | None = None
    sent_at: float | None = None
    first_token_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


@dataclass
class ReplayReport:
    results: list[RequestResult]
    duration_s: float
    ttft_slo_s: float
    tpot_slo_s: float
    meta: dict = field(default_factory=dict)

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    def ttft(self, q: float) -> float:
        return percentile([r.ttft_s for r in self.ok], q)

    def tpot(self, q: float) -> float:
        return percentile([r.tpot_s for r in self.ok if r.tpot_s is not None], q)

    def latency(self, q: float) -> float:
        """Send -> last byte, percentile q over the requests that succeeded."""
        return percentile([r.latency_s for r in self.ok], q)

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.ok) / self.duration_s if self.duration_s else 0.0

    @property
    def request_throughput(self) -> float:
        return len(self.ok) / self.duration_s if self.duration_s else 0.0

    def meets_slo(self, r: RequestResult) -> bool:
        return r.ok and r.ttft_s <= self.ttft_slo_s and (r.tpot_s is None or r.tpot_s <= self.tpot_slo_s)

    @property
    def slo_attainment(self) -> float:
        """Share of all sent requests (failed ones count as misses) that met both the TTFT and TPOT SLO."""
        return sum(self.meets_slo(r) for r in self.results) / len(self.results) if self.results else 0.0

    def summary(self) -> str:
        errors = [r.error for r in self.results if r.error]
        lines = [
            f"requests: {len(self.results)} sent, {len(self.ok)} ok, {len(errors)} failed"
            + (f" (first error: {errors[0]})" if errors else ""),
            f"duration: {self.duration_s:.1f} s; throughput {self.output_throughput:.1f} output tok/s, "
            f"{self.request_throughput:.3f} req/s",
            "TTFT s  P50 {:.3f}  P95 {:.3f}  P99 {:.3f}".format(self.ttft(50), self.ttft(95), self.ttft(99)),
            "TPOT s  P50 {:.4f}  P95 {:.4f}  P99 {:.4f}".format(self.tpot(50), self.tpot(95), self.tpot(99)),
            f"SLO (TTFT <= {self.ttft_slo_s} s and TPOT <= {self.tpot_slo_s} s): {100 * self.slo_attainment:.1f} %",
        ]
        return "\n".join(lines)

    def result_lines(self, prefix: str = "replay") -> list[str]:
        values = {
            "ttft_p50_s": self.ttft(50), "ttft_p95_s": self.ttft(95), "ttft_p99_s": self.ttft(99),
            "tpot_p50_s": self.tpot(50), "tpot_p95_s": self.tpot(95), "tpot_p99_s": self.tpot(99),
            "output_tok_per_s": self.output_throughput, "req_per_s": self.request_throughput,
            "failed_requests": len(self.results) - len(self.ok), "slo_attainment": self.slo_attainment,
        }
        return [f"RESULT {prefix}_{k} {v:.4g}" for k, v in values.items()]


# ---------------------------------------------------------------- replay
async def _send(client: httpx.AsyncClient, url: str, body: dict, result: RequestResult) -> None:
    sent = time.perf_counter()
    result.sent_at = time.time()
    first = last = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk["error"]))
                    return
                result.response_id = result.response_id or chunk.get("id")
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if any(c.get("text") for c in chunk.get("choices", ())):
                    last = time.perf_counter()
                    if first is None:
                        first, result.first_token_at = last, time.time()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return
    end = time.perf_counter()
    if first is None:
        result.error = result.error or "no token received"
        return
    result.ttft_s = first - sent
    result.latency_s = end - sent
    if result.output_tokens > 1:
        result.tpot_s = (last - first) / (result.output_tokens - 1)


async def replay_async(base_url: str, requests: list[ReplayRequest], *, model: str | None = None,
                       api_key: str | None = None, ttft_slo_s: float = 2.0, tpot_slo_s: float = 0.2,
                       timeout_s: float = 600.0, progress: bool = True) -> ReplayReport:
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=len(requests) + 8, max_keepalive_connections=len(requests) + 8)
    async with httpx.AsyncClient(headers=headers, timeout=timeout_s, limits=limits) as client:
        if model is None:
            model = (await client.get(base_url + "/v1/models")).json()["data"][0]["id"]
        results = [RequestResult(r.arrival_s, r.prompt_tokens) for r in requests]
        bar = tqdm(total=len(requests), desc="replay", unit="req", disable=not progress)
        start = time.perf_counter()

        async def one(req: ReplayRequest, result: RequestResult):
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)  # open loop: the schedule does not wait for earlier requests
            body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
                    "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
            await _send(client, base_url + "/v1/completions", body, result)
            bar.update(1)

        await asyncio.gather(*(one(r, res) for r, res in zip(requests, results)))
        duration = time.perf_counter() - start
        bar.close()
    return ReplayReport(results, duration, ttft_slo_s, tpot_slo_s, {"model": model, "base_url": base_url})


def run_replay(base_url: str, requests: list[ReplayRequest], **kwargs) -> ReplayReport:
    """Synchronous entry point for other benchmarks; see replay_async for the keyword arguments."""
    return asyncio.run(replay_async(base_url, requests, **kwargs))


# ---------------------------------------------------------------- server management
def free_port() -> int:
    """A loopback port below the kernel's ephemeral range: a bind(0) port, closed before the server binds it,
    could meanwhile go to one of that server's own workers (its rendezvous store, gloo listeners)."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        first_ephemeral = int(ports.read().split()[0])
    for port in random.sample(range(10_000, first_ephemeral), 200):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in 10000-{first_ephemeral - 1} after 200 tries")


class ServerProcess:
    """An OpenAI-compatible server in a subprocess (its own GIL, like a real deployment), stopped with SIGINT:
    `elastic-hf serve serve_args...` by default, or `command` (another engine's server; `--port` is appended)."""

    def __init__(self, serve_args: list[str] = (), *, command: list[str] | None = None, env: dict | None = None,
                 stdout=None, startup_timeout_s: float = 300.0):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        base = command or [sys.executable, "-m", "elastic_hf.serving.serve_cmd", *serve_args, "--log-level", "warning"]
        cmd = [*base, "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, cwd=PROJECT_ROOT, env=env, stdout=stdout)
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up: {' '.join(cmd)}")
            try:
                if httpx.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not healthy after {startup_timeout_s} s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------- command line
def _load_tokenizer(name_or_path: str | None):
    from transformers import AutoTokenizer

    if name_or_path is None or Path(name_or_path).suffix == ".gguf":
        from elastic_hf.model.loader import resolve_model
        name_or_path = str(resolve_model(name_or_path).checkpoint_dir)
    return AutoTokenizer.from_pretrained(name_or_path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    target = ap.add_mutually_exclusive_group()
    target.add_argument("--url", default="http://127.0.0.1:8000", help="base URL of a running server")
    target.add_argument("--start-server", action="store_true", help="start `elastic-hf serve` for the run")
    ap.add_argument("--model", default=None, help="model to serve with --start-server, and whose tokenizer builds "
                                                  "the prompts (default: the embedded default model)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: --model's)")
    ap.add_argument("--api-key", default=None, help="bearer key of the server (else $ELASTIC_HF_API_KEY)")
    ap.add_argument("--serve-args", default="", help="extra flags for elastic-hf serve, one string")
    ap.add_argument("--trace", default="code", help=f"{' or '.join(TRACES)} (benchmarks/data) or a CSV path")
    ap.add_argument("--start", type=int, default=0, help="first trace row to replay")
    ap.add_argument("--num-requests", type=int, default=48, help="trace rows to replay")
    ap.add_argument("--rate", type=float, default=0.5,
                    help="mean arrival rate in req/s after time scaling; sets --time-scale unless that is given")
    ap.add_argument("--time-scale", type=float, default=None, help="factor on trace inter-arrival times")
    ap.add_argument("--prompt-scale", type=float, default=None,
                    help="factor on trace prompt tokens (default: 1/16 for code, 1/4 for conv)")
    ap.add_argument("--output-scale", type=float, default=1.0, help="factor on trace output tokens")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="cap on scaled prompt tokens")
    ap.add_argument("--max-output-tokens", type=int, default=64, help="cap on scaled output tokens")
    ap.add_argument("--ttft-slo", type=float, default=2.0, help="TTFT SLO in seconds")
    ap.add_argument("--tpot-slo", type=float, default=0.25, help="TPOT SLO in seconds")
    ap.add_argument("--seed", type=int, default=0, help="seed of the prompt windows")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = ap.parse_args(argv)

    rows = load_trace(args.trace, start=args.start, num_requests=args.num_requests)
    time_scale = args.time_scale if args.time_scale is not None else time_scale_for_rate(rows, args.rate)
    scale = TraceScale(time_scale, prompt_scale_for(args.trace, args.prompt_scale), args.output_scale,
                       args.max_prompt_tokens, args.max_output_tokens)
    scaled = scale_trace(rows, scale)
    requests = build_requests(scaled, _load_tokenizer(args.tokenizer or args.model), seed=args.seed)
    span = scaled[-1].arrival_s
    # The load average matters on a shared machine: other processes take cores from the server.
    print(f"machine: {machine_description()}, load average {os.getloadavg()[0]:.1f} at start")
    print(f"trace: {trace_path(args.trace).name} rows {args.start}..{args.start + len(rows) - 1} "
          f"({rows[-1].arrival_s:.1f} s of trace, {len(rows) / max(rows[-1].arrival_s, 1e-9):.2f} req/s)")
    print(f"scale factors: {scale.describe()}")
    print(f"replay: {len(requests)} requests over {span:.1f} s ({len(requests) / max(span, 1e-9):.2f} req/s), "
          f"prompt tokens mean {sum(r.prompt_tokens for r in requests) / len(requests):.0f}, "
          f"output tokens mean {sum(r.max_tokens for r in requests) / len(requests):.1f}")

    server = None
    base_url = args.url
    if args.start_server:
        serve_args = ([args.model] if args.model else []) + args.serve_args.split()
        server = ServerProcess(serve_args)
        base_url = server.base_url
    try:
        api_key = args.api_key or os.environ.get("ELASTIC_HF_API_KEY")
        report = run_replay(base_url, requests, api_key=api_key, ttft_slo_s=args.ttft_slo,
                            tpot_slo_s=args.tpot_slo, progress=not args.no_progress)
    finally:
        if server is not None:
            server.stop()
    print(f"server: {base_url}, model {report.meta['model']}, load average {os.getloadavg()[0]:.1f} at end")
    print(report.summary())
    for line in report.result_lines():
        print(line)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
