"""Helpers of the serving tests (fixtures live in conftest.py): real servers, i.e. uvicorn in a background
thread of the test process, on a free loopback port, over a real ElasticModel. Most tests use a tiny
random-weight Llama with the default model's real tokenizer, so text and chat templates are real; one module
uses the default model for a quality check.

Reference outputs are computed with the same engine, synchronously, before the server takes it over: "the
server's greedy output equals the engine's own greedy output" then compares like with like."""
from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

# a port for a server subprocess: benchmarks/replay.py's pick, from below the kernel's ephemeral range (a bind(0)
# port, closed before the subprocess binds it, could meanwhile go to that server's own workers: a CI run saw it)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from replay import free_port  # noqa: E402,F401

TINY_MAX_MODEL_LEN = 1024
API_KEY = "test-key-123"
# Prompts of mixed lengths; every test that checks text picks from these so references are computed once.
PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "The history of the Roman Empire spans more than a thousand years, from the founding of the city",
    "Hello",
    "In machine learning, a transformer is",
    "Paris is the capital of",
]
MAX_TOKENS = 24


@dataclass
class Server:
    base_url: str
    model_id: str
    model: object            # ElasticModel
    async_engine: object     # AsyncEngine
    api_key: str | None
    reference: dict = field(default_factory=dict)   # prompt -> greedy text of MAX_TOKENS tokens
    chat_reference: dict = field(default_factory=dict)  # user message -> greedy text

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stats(self) -> dict:
        return self.async_engine.stats()

    def wait_idle(self, timeout: float = 60.0) -> dict:
        """Wait (bounded) until the engine holds no request and no KV block; returns the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            if stats.get("kv_blocks_used") == 0 and stats.get("num_requests", 0) == 0 \
                    and stats.get("num_streams") == 0:
                return stats
            if time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def metric(self, name: str, labels: str = "") -> float:
        """Value of one /metrics sample: metric("elastic_hf_requests_finished_total", 'finish_reason="abort"')."""
        text = httpx.get(self.base_url + "/metrics", timeout=30).text
        for line in text.splitlines():
            if line.startswith(name + ("{" if labels else " ")) and (not labels or labels in line):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name}{{{labels}}} not in /metrics")


def wait_until_healthy(proc, base: str, timeout_s: float, output=lambda: "") -> None:
    """Poll /health of the server subprocess `proc` (at `base`) until it answers 200; fails with the server's
    `output()` when the process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, f"server exited early:\n{output()}"
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"server not healthy in {timeout_s:.0f} s:\n{output()}"
        time.sleep(0.2)


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _greedy_references(model, prompts, chats) -> tuple[dict, dict]:
    outs = model.generate(list(prompts), max_tokens=MAX_TOKENS, temperature=0.0)
    reference = {p: o.outputs[0].text for p, o in zip(prompts, outs)}
    chat_reference = {}
    for message in chats:
        out = model.chat([{"role": "user", "content": message}], max_tokens=MAX_TOKENS, temperature=0.0)
        chat_reference[message] = out.outputs[0].text
    return reference, chat_reference


def start_server(model, *, api_key=None, prompts=(), chats=(), max_body_bytes=64 * 1024, request_timeout=None,
                 served_model_name=None, admin_key=None, **app_options):
    """admin_key: also mount /admin/morph, /admin/reshape and the prefix-cache routes behind that key, as
    `elastic-hf serve` does."""
    import uvicorn

    from elastic_hf.engine.async_engine import AsyncEngine
    from elastic_hf.serving.app import build_app

    reference, chat_reference = _greedy_references(model, prompts, chats)
    async_engine = AsyncEngine(model.engine, request_timeout=request_timeout).start()
    served = served_model_name or model.model_id
    app = build_app(async_engine, api_key=api_key, model_id=served, max_body_bytes=max_body_bytes, **app_options)
    if admin_key is not None:
        from elastic_hf.serving.admin_morph import admin_morph_router
        from elastic_hf.serving.admin_reshape import admin_reshape_router

        app.include_router(admin_morph_router(model, async_engine, admin_key))
        app.include_router(admin_reshape_router(model, async_engine, admin_key))
        from elastic_hf.serving.admin_cache import admin_cache_router

        app.include_router(admin_cache_router(model, async_engine, admin_key))
    sock = _free_socket()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                                           timeout_keep_alive=30))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name="uvicorn")
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start within 30 s")
        time.sleep(0.01)
    handle = Server(f"http://127.0.0.1:{port}", served, model, async_engine, api_key, reference,
                    chat_reference)

    def stop():
        server.should_exit = True
        thread.join(10)
        async_engine.shutdown()
        sock.close()

    return handle, stop


@contextlib.contextmanager
def tiny_model_server(checkpoint, *, max_model_len: int = TINY_MAX_MODEL_LEN, kv_cache_memory: int = 16 << 20,
                      model_options: dict | None = None, **server_options):
    """A server over its own ElasticModel of `checkpoint` (a module fixture's: `with tiny_model_server(...) as s:
    yield s`); server_options go to start_server, model_options to from_pretrained."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(checkpoint, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                                         **(model_options or {}))
    handle, stop = start_server(model, **server_options)
    try:
        yield handle
    finally:
        stop()


class StreamingClient(threading.Thread):
    """One streaming /v1/completions request through the real (sync) `openai` client, in a thread.

    `ready` is set once `ready_after` text chunks arrived (the request is decoding), or when the stream ends
    earlier. With `leave` (a threading.Event) the client stops reading after `ready_after` chunks, waits for
    `leave` and then closes its connection mid-stream (`closed_early`). Results: text, chunks, finish_reason,
    completion_tokens (from the usage chunk), error (any exception, e.g. openai.APIError for an SSE error
    event). Every wait is bounded by `timeout` (the client's read timeout, and the wait for `leave`)."""

    def __init__(self, server: Server, prompt: str, max_tokens: int, *, ready_after: int = 2,
                 leave: threading.Event | None = None, timeout: float = 60.0, **extra):
        super().__init__(daemon=True, name=f"stream-client-{prompt[:12]}")
        self.server, self.prompt, self.max_tokens = server, prompt, max_tokens
        self.ready_after, self.leave, self.timeout, self.extra = ready_after, leave, timeout, extra
        self.ready = threading.Event()
        self.text, self.chunks = "", 0
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None
        self.error: BaseException | None = None
        self.closed_early = False
        self.text_at: dict[str, str] = {}   # snapshots of `text` taken by `mark(name)` from another thread

    def mark(self, name: str) -> None:
        self.text_at[name] = self.text

    def run(self) -> None:
        import openai

        client = openai.OpenAI(base_url=self.server.base_url + "/v1", api_key=self.server.api_key or "none",
                               max_retries=0, timeout=self.timeout)
        try:
            stream = client.completions.create(model=self.server.model_id, prompt=self.prompt,
                                               max_tokens=self.max_tokens, temperature=0, stream=True,
                                               stream_options={"include_usage": True}, **self.extra)
            try:
                for chunk in stream:
                    if chunk.usage is not None:
                        self.completion_tokens = chunk.usage.completion_tokens
                    for choice in chunk.choices:
                        self.text += choice.text
                        self.finish_reason = choice.finish_reason or self.finish_reason
                        if choice.text:
                            self.chunks += 1
                    if self.chunks >= self.ready_after:
                        self.ready.set()
                        if self.leave is not None:
                            if not self.leave.wait(self.timeout):
                                raise TimeoutError(f"nobody set `leave` within {self.timeout} s")
                            self.closed_early = True
                            break
            finally:
                stream.close()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc
        finally:
            self.ready.set()
            client.close()
