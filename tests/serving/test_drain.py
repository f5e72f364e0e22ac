"""Graceful shutdown and request timeouts of `elastic-hf serve`, over real processes and real HTTP.

SIGTERM starts a drain: streams in flight run to their end (finish_reason, `data: [DONE]`) while a new request
gets 503 with Retry-After and /health says "draining"; the server exits 0 and leaves no worker process behind.
Past --shutdown-timeout the streams still running end with an SSE error event and `[DONE]`, a plain request with
an error body. --request-timeout aborts one request in the engine (its KV blocks come back) and leaves the others
alone."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from serving_helpers import PROMPTS, TINY_MAX_MODEL_LEN, free_port, start_server, wait_until_healthy

pytestmark = pytest.mark.stress   # see tests/conftest.py

MAX_MODEL_LEN = 1024
NUM_STREAMS = 8
DRAINED_MAX_TOKENS = 320               # seconds of decoding with 2 workers on 2 cores: time to probe the drain
CUT_MAX_TOKENS = MAX_MODEL_LEN - 64    # far more than fits the short shutdown timeout


# ---------------------------------------------------------------- a real `elastic-hf serve` process

class ServeProcess:
    """`python -m elastic_hf.serving.serve_cmd ARGS` in its own session (so a failed test can kill what it left,
    workers included), output in a file (a pipe nobody reads could block the server)."""

    def __init__(self, args: list[str], start_timeout_s: float = 120):
        port = free_port()
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "elastic_hf.serving.serve_cmd", *args, "--port", str(port),
                                      "--log-level", "warning"], stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.base = f"http://127.0.0.1:{port}"
        wait_until_healthy(self.proc, self.base, start_timeout_s, self.output)
        self.model_id = httpx.get(self.base + "/v1/models", timeout=10).json()["data"][0]["id"]

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-6000:]

    def children(self) -> set[int]:
        """PIDs of the server's child processes (workers, multiprocessing's resource tracker)."""
        pids = set()
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids |= {int(pid) for pid in (task / "children").read_text().split()}
        return pids

    def kill(self) -> None:
        """Whatever is left of the session, after a failure (a no-op after a clean exit)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self.log.close()


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that may never reap it in a container counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: set[int], timeout_s: float = 15) -> set[int]:
    deadline = time.monotonic() + timeout_s
    while {p for p in pids if _alive(p)} and time.monotonic() < deadline:
        time.sleep(0.1)
    return {p for p in pids if _alive(p)}


class RawStream(threading.Thread):
    """One streaming request read as raw SSE `data:` payloads, so the test sees exactly what the server sent."""

    def __init__(self, base: str, path: str, body: dict):
        super().__init__(daemon=True)
        self.base, self.path, self.body = base, path, body
        self.events: list[str] = []
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.status: int | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.base + self.path, json={**self.body, "stream": True},
                              timeout=httpx.Timeout(60, connect=10)) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[len("data: "):])
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    @property
    def chunks(self) -> list[dict]:
        return [json.loads(e) for e in self.events if e != "[DONE]"]

    @property
    def finish_reasons(self) -> list[str]:
        return [c["finish_reason"] for chunk in self.chunks for c in chunk.get("choices", ())
                if c.get("finish_reason")]

    @property
    def errors(self) -> list[dict]:
        return [chunk["error"] for chunk in self.chunks if "error" in chunk]


def _start_streams(server: ServeProcess, max_tokens: int) -> list[RawStream]:
    """NUM_STREAMS long greedy generations, half completions and half chat completions, all decoding."""
    streams = []
    for i in range(NUM_STREAMS):
        common = {"model": server.model_id, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        if i % 2:
            streams.append(RawStream(server.base, "/v1/chat/completions",
                                     {**common, "messages": [{"role": "user", "content": PROMPTS[i]}]}))
        else:
            streams.append(RawStream(server.base, "/v1/completions", {**common, "prompt": PROMPTS[i]}))
    for s in streams:
        s.start()
    for s in streams:
        assert s.first.wait(60) and s.error is None and s.status == 200, (s.status, s.error, s.events)
    return streams


def _serve_args(checkpoint: str, workers: int, *extra: str) -> list[str]:
    return [checkpoint, "--workers", str(workers), "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", "64MiB",
            "--max-num-seqs", str(NUM_STREAMS), *extra]


def test_sigterm_drains_streams_to_their_end_and_stops_the_workers(serving_checkpoint):
    server = ServeProcess(_serve_args(serving_checkpoint, 2, "--shutdown-timeout", "60"))
    try:
        workers = server.children()
        assert len(workers) >= 2, f"expected 2 worker processes, got children {workers}"
        streams = _start_streams(server, DRAINED_MAX_TOKENS)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()

        # During the drain: load balancers see 503 "draining", a new request gets 503 with Retry-After.
        health = httpx.get(server.base + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining", health.text
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=server.model_id, prompt="Hello", max_tokens=4)
        response = refused.value.response
        assert response.status_code == 503 and int(response.headers["retry-after"]) >= 1
        assert response.json()["error"]["code"] == "server_draining"
        probed = time.monotonic()
        assert all(s.is_alive() for s in streams), "the streams ended before the drain was observed"

        for s in streams:
            s.join(60)
        for i, s in enumerate(streams):
            assert s.error is None and not s.is_alive(), (i, s.error)
            assert s.events and s.events[-1] == "[DONE]", (i, s.events[-3:])
            assert not s.errors, (i, s.errors)
            assert s.finish_reasons == ["length"], (i, s.finish_reasons)
            assert s.ended_at > probed
        assert server.proc.wait(30) == 0, server.output()
        assert time.monotonic() - signalled < 60, "the drain took longer than its timeout"
        assert not _wait_gone(workers), f"processes of the server left alive: {workers}\n{server.output()}"
    finally:
        server.kill()


def test_streams_past_the_shutdown_timeout_end_with_an_error_event_and_done(serving_checkpoint):
    shutdown_timeout = 1.0
    # One worker: a second deployment of two would double the test's time, and the drain does not depend on it.
    server = ServeProcess(_serve_args(serving_checkpoint, 1, "--shutdown-timeout", str(shutdown_timeout)))
    try:
        children = server.children()
        streams = _start_streams(server, CUT_MAX_TOKENS)
        plain: dict = {}

        def non_streaming():
            client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=60)
            try:
                client.completions.create(model=server.model_id, prompt=PROMPTS[0], max_tokens=CUT_MAX_TOKENS,
                                          temperature=0, extra_body={"ignore_eos": True})
            except openai.APIStatusError as exc:
                plain["error"] = exc
        plain_thread = threading.Thread(target=non_streaming, daemon=True)
        plain_thread.start()
        # It must be in the engine before the signal: a request after it is refused, not drained.
        deadline = time.monotonic() + 30
        while httpx.get(server.base + "/health", timeout=10).json().get("num_streams", 0) < NUM_STREAMS + 1:
            assert time.monotonic() < deadline and plain_thread.is_alive(), plain
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        for s in streams:
            s.join(30)
        plain_thread.join(30)
        for i, s in enumerate(streams):
            assert s.error is None and not s.is_alive(), (i, s.error)
            assert s.events[-1] == "[DONE]", (i, s.events[-3:])
            (error,) = s.errors
            assert json.loads(s.events[-2]) == {"error": error}, "the error event comes right before [DONE]"
            assert f"{shutdown_timeout:g} s shutdown timeout" in error["message"], error
            assert error["type"] == "server_error" and error["code"] == "engine_unavailable"
            assert not s.finish_reasons, "a stream cut by the shutdown has no finish_reason"
            assert s.ended_at - signalled > shutdown_timeout * 0.9, "the stream was not given its drain time"
        assert "error" in plain and plain["error"].status_code == 503, plain
        assert plain["error"].response.json()["error"]["code"] == "engine_unavailable"
        assert server.proc.wait(30) == 0, server.output()
        assert time.monotonic() - signalled < shutdown_timeout + 20
        assert not _wait_gone(children), f"processes of the server left alive: {children}\n{server.output()}"
    finally:
        server.kill()


# ---------------------------------------------------------------- --request-timeout, in-process server

REQUEST_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def timeout_server(serving_checkpoint):
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=64 << 20, max_num_seqs=16)
    handle, stop = start_server(model, prompts=[PROMPTS[0]], request_timeout=REQUEST_TIMEOUT_S)
    yield handle
    stop()


def test_request_timeout_aborts_the_long_request_and_not_the_short_one(timeout_server):
    server = timeout_server
    long_tokens = TINY_MAX_MODEL_LEN - 64   # seconds of decoding, far past the timeout
    stream = RawStream(server.base_url, "/v1/completions",
                       {"model": server.model_id, "prompt": PROMPTS[1], "max_tokens": long_tokens,
                        "temperature": 0, "ignore_eos": True})
    stream.start()
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
    started = time.monotonic()
    plain: dict = {}

    def long_plain():
        try:
            client.completions.create(model=server.model_id, prompt=PROMPTS[2], max_tokens=long_tokens,
                                      temperature=0, extra_body={"ignore_eos": True})
        except openai.APIStatusError as exc:
            plain["error"], plain["at"] = exc, time.monotonic()
    plain_thread = threading.Thread(target=long_plain, daemon=True)
    plain_thread.start()
    assert stream.first.wait(30)
    short = client.completions.create(model=server.model_id, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert short.choices[0].text == server.reference[PROMPTS[0]] and short.choices[0].finish_reason == "length"

    plain_thread.join(30)
    stream.join(30)
    assert "error" in plain, "the long request was not timed out"
    error = plain["error"]
    assert error.status_code == 504, error
    body = error.response.json()["error"]
    assert body["code"] == "request_timeout" and f"{REQUEST_TIMEOUT_S:g} s request timeout" in body["message"]
    assert REQUEST_TIMEOUT_S * 0.9 < plain["at"] - started < REQUEST_TIMEOUT_S + 5
    assert stream.events[-1] == "[DONE]", stream.events[-3:]
    (event,) = stream.errors
    assert json.loads(stream.events[-2]) == {"error": event}
    assert event["code"] == "request_timeout" and f"{REQUEST_TIMEOUT_S:g} s" in event["message"]
    assert not stream.finish_reasons
    # Aborted in the engine, not only answered: the blocks are free long before the generations could end.
    stats = server.wait_idle(timeout=1)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0 and stats["num_streams"] == 0, stats
