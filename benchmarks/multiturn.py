"""Multi-turn chat sessions sharing a long system prompt: time to first token of the later turns with elastic-hf's
prefix cache on and off, and against vLLM's CPU build with its prefix caching on (its default).

    python benchmarks/multiturn.py [--sessions 6] [--turns 4] [--system-tokens 900] [--repeats 3]
                                   [--dtype float32] [--skip-vllm] [--reshape]

Every session is one asyncio task of the real `openai.AsyncOpenAI` client on loopback: the system prompt (the same
~900 tokens of WikiText-2 prose for every session), then `--turns` user turns (WikiText-2 snippets of 32-128 tokens,
the range of a chat turn; the Azure trace we ship is the code service's, so no conversation lengths are replayed),
each sent when the previous answer has ended, with the whole history: greedy answers of 32-64 tokens, streamed. The
sessions run concurrently. TTFT is request sent -> first content chunk; "later turns" are turns 2.. of every
session, where a prefix cache can reuse the history. Engines run one after the other in every round, in alternating
order, each a fresh server process with the same cores and threads; figures are medians over the rounds with their
spread. The cache's hit rate comes from each server's `vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`.

--reshape: one more elastic-hf run with two workers (two TP1 instances) that merges them into one TP2 instance after
the second turn (POST /admin/reshape): the per-turn cached tokens (usage.prompt_tokens_details.cached_tokens) show
what the cache held before and after it.

Prints the table and `RESULT prefix_cache_ttft_gain` (later-turn TTFT p50, cache off / on) and
`RESULT vs_vllm_multiturn_ttft_p50` (vLLM's / ours): > 1 means elastic-hf is faster."""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import wikitext_text  # noqa: E402
from replay import ServerProcess  # noqa: E402
from vs_vllm import cpu_env, vllm_python  # noqa: E402

ADMIN_KEY = "multiturn-bench"


@dataclass
class Session:
    system: str
    turns: list[str]
    max_tokens: list[int]


@dataclass
class RunReport:
    ttft_later: list[float] = field(default_factory=list)   # seconds, turns 2.. of every session
    ttft_first: list[float] = field(default_factory=list)
    seconds: float = 0.0
    hit_rate: float = 0.0
    cached_by_turn: dict[int, list[tuple[int, int]]] = field(default_factory=dict)   # turn -> (cached, prompt)


def build_sessions(args) -> list[Session]:
    """Text cut from WikiText-2 at word boundaries: one system prompt for all, different user turns per session."""
    from transformers import AutoTokenizer

    from elastic_hf.model.loader import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(None).checkpoint_dir))
    ids = tokenizer.encode(wikitext_text()[:400_000], add_special_tokens=False)
    rng = random.Random(args.seed)

    def snippet(length: int) -> str:
        start = rng.randint(0, len(ids) - length - 1)
        return tokenizer.decode(ids[start:start + length]).strip()

    system = "You are a helpful assistant. Answer from this background.\n\n" + snippet(args.system_tokens)
    return [Session(system, [snippet(rng.randint(32, 128)) for _ in range(args.turns)],
                    [rng.randint(32, 64) for _ in range(args.turns)]) for _ in range(args.sessions)]


async def run_session(client, session: Session, report: RunReport, turn_done: asyncio.Barrier | None) -> None:
    messages = [{"role": "system", "content": session.system}]
    for turn, (text, max_tokens) in enumerate(zip(session.turns, session.max_tokens)):
        messages.append({"role": "user", "content": text})
        sent = time.perf_counter()
        first, answer, usage = None, [], None
        stream = await client.chat.completions.create(model="model", messages=messages, max_tokens=max_tokens,
                                                      temperature=0, stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                if first is None:
                    first = time.perf_counter() - sent
                answer.append(chunk.choices[0].delta.content)
        (report.ttft_later if turn else report.ttft_first).append(first if first is not None else 0.0)
        details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
        cached = (details.cached_tokens or 0) if details is not None else 0
        report.cached_by_turn.setdefault(turn, []).append((cached, usage.prompt_tokens if usage else 0))
        messages.append({"role": "assistant", "content": "".join(answer)})
        if turn_done is not None:
            await turn_done.wait()


def prefix_cache_counters(base_url: str) -> tuple[float, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M))
    return total("prefix_cache_hits"), total("prefix_cache_queries")


def run_engine(engine: str, args, checkpoint: str, vllm, env, sessions: list[Session]) -> RunReport:
    import openai

    if engine == "vllm":
        server = ServerProcess(command=[str(vllm), "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
                                        "--dtype", args.dtype, "--max-model-len", "4096", "--served-model-name",
                                        "model", "--uvicorn-log-level", "warning"],
                               env=env, stdout=subprocess.DEVNULL, startup_timeout_s=600)
    else:
        flags = [checkpoint, "--dtype", args.dtype, "--served-model-name", "model", "--max-model-len", "4096"]
        if engine == "elastic-off":
            flags.append("--no-enable-prefix-caching")
        if engine == "elastic-reshape":
            flags += ["--workers", "2", "--admin-key", ADMIN_KEY]
        server = ServerProcess(flags, env=env)
    report = RunReport()
    try:
        async def main():
            async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                                          timeout=600) as client:
                barrier = asyncio.Barrier(len(sessions)) if engine == "elastic-reshape" else None
                tasks = [asyncio.create_task(run_session(client, s, report, barrier)) for s in sessions]
                if barrier is not None:
                    await reshape_after_turn(server.base_url, report, len(sessions), turn=1)
                await asyncio.gather(*tasks)

        started = time.perf_counter()
        asyncio.run(main())
        report.seconds = time.perf_counter() - started
        hits, queries = prefix_cache_counters(server.base_url)
        report.hit_rate = hits / queries if queries else 0.0
    finally:
        server.stop()
    return report


async def reshape_after_turn(base_url: str, report: RunReport, num_sessions: int, turn: int) -> None:
    """Merge the two TP1 instances into one TP2 instance once every session has finished `turn`."""
    while len(report.cached_by_turn.get(turn, [])) < num_sessions:
        await asyncio.sleep(0.05)
    async with httpx.AsyncClient(timeout=600) as http:
        resp = await http.post(base_url + "/admin/reshape", json={"topology": [2]},
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        resp.raise_for_status()
    tqdm.write(f"reshaped to TP2 after turn {turn + 1}")


def _spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=900)
    parser.add_argument("--repeats", type=int, default=3, help="rounds; figures are medians over them")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--reshape", action="store_true", help="also a two-worker run that reshapes mid-session")
    args = parser.parse_args()

    from elastic_hf.model.loader import resolve_model

    checkpoint = str(resolve_model(None).checkpoint_dir)
    sessions = build_sessions(args)
    env = cpu_env(os.cpu_count() or 1)
    engines = ["elastic", "elastic-off"] + ([] if args.skip_vllm else ["vllm"])
    vllm = None if args.skip_vllm else vllm_python()
    print(f"{args.sessions} sessions x {args.turns} turns, system prompt ~{args.system_tokens} tokens, {args.dtype}, "
          f"{args.repeats} rounds")
    runs: dict[str, list[RunReport]] = {e: [] for e in engines}
    with tqdm(total=args.repeats * len(engines), desc="runs") as bar:
        for round_index in range(args.repeats):
            order = engines if round_index % 2 == 0 else engines[::-1]
            for engine in order:
                report = run_engine(engine, args, checkpoint, vllm, env, sessions)
                runs[engine].append(report)
                tqdm.write(f"round {round_index + 1} {engine:12s} later-turn TTFT p50 "
                           f"{statistics.median(report.ttft_later):.3f} s, whole run {report.seconds:.1f} s, "
                           f"hit rate {report.hit_rate:.2f}")
                bar.update()

    def p(values: list[float], q: float) -> float:
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]

    med = {e: {"p50": statistics.median(p(r.ttft_later, 50) for r in runs[e]),
               "p95": statistics.median(p(r.ttft_later, 95) for r in runs[e]),
               "first": statistics.median(statistics.median(r.ttft_first) for r in runs[e]),
               "seconds": statistics.median(r.seconds for r in runs[e]),
               "hit": statistics.median(r.hit_rate for r in runs[e])} for e in engines}
    print("\n| engine | later-turn TTFT p50 (spread) | p95 | first-turn TTFT p50 | whole run | hit rate |")
    print("|---|---|---|---|---|---|")
    for e in engines:
        spread = _spread([p(r.ttft_later, 50) for r in runs[e]])
        print(f"| {e} | {med[e]['p50']:.3f} s ({spread}) | {med[e]['p95']:.3f} s | {med[e]['first']:.3f} s "
              f"| {med[e]['seconds']:.1f} s | {med[e]['hit']:.2f} |")
    print(f"RESULT prefix_cache_ttft_gain {med['elastic-off']['p50'] / med['elastic']['p50']:.3f}")
    if not args.skip_vllm:
        print(f"RESULT vs_vllm_multiturn_ttft_p50 {med['vllm']['p50'] / med['elastic']['p50']:.3f}")
    if args.reshape:
        report = run_engine("elastic-reshape", args, checkpoint, vllm, env, sessions)
        print("\nreshape run (2 workers, TP1+TP1 -> TP2 after turn 2): cached / prompt tokens per turn")
        for turn, pairs in sorted(report.cached_by_turn.items()):
            cached, prompt = sum(c for c, _ in pairs), sum(n for _, n in pairs)
            print(f"  turn {turn + 1}: {cached} / {prompt} ({cached / prompt:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
