"""Asyncio front of the synchronous LLMEngine.

The LLMEngine is not thread-safe, so exactly one background thread owns it: it executes add/abort commands
from a locked list and runs `step()` while there is work, and sleeps on a condition variable otherwise (no busy
spin). Outputs travel back to per-request asyncio queues through `loop.call_soon_threadsafe`, so the event loop
never blocks on a model step and many HTTP clients share one batch. With `request_timeout` the engine thread
aborts a request that runs longer and ends its stream with RequestTimedOut.

`start(build=...)` builds the model on the engine thread itself. OpenMP keeps one thread pool per thread that
opens parallel regions; a model loaded on one thread and stepped on another leaves two pools, and once the
process has more OpenMP threads than cores libgomp stops spinning between regions, so every one of a step's
hundreds of parallel regions waits for a futex wake-up (measured: a batch-1 fp32 decode step 16.5 -> 24.8 ms,
a 97-token prefill 72 -> 118 ms on 2 cores). One thread doing all of the data plane's tensor work keeps one pool.
"""
from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from elastic_hf.engine.errors import EngineDeadError, EngineDraining, EngineError, EngineOverloaded, RequestTimedOut
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.protocol import EngineCore
from elastic_hf.engine.request_stream import RequestStream, StreamQueue
from elastic_hf.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
UNHEALTHY_AFTER_FAILED_STEPS = 3   # failed steps in a row (one is a bad batch; several, a broken worker or kernel)


class AsyncEngine:
    def __init__(self, engine: EngineCore | None = None, *, name: str = "elastic-hf-engine",
                 request_timeout: float | None = None):
        """engine: None when `start(build=...)` makes it on the engine thread."""
        self.engine = engine
        self.request_timeout = request_timeout
        self.draining = False    # set by drain(), never cleared: a drained engine is shut down next
        self._pending_adds = 0   # adds queued or being executed; with `_streams` they make the requests in flight
        self._name = name
        self._cond = threading.Condition()
        self._commands: list[tuple] = []
        self._streams: dict[str, StreamQueue] = {}   # touched only on the engine thread
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._stats: dict = {}
        self._num_step_errors = 0
        self._consecutive_step_errors = 0   # reset by a step that succeeds
        self._last_error: str | None = None
        self._ids = itertools.count()
        self._id_prefix = uuid.uuid4().hex[:8]
        # Tokenization, chat templates and validation (engine/input_processor.py) run here: off the event loop and
        # off the engine thread. One thread: the tokenizer is used by one caller at a time.
        self._input_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-inputs")
        if engine is not None:
            self._refresh_stats()

    # ---- properties the server reads ----
    @property
    def model_id(self) -> str:
        return self.engine.model_id

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def default_sampling(self) -> dict:
        """Values of sampling fields a request leaves unset (model/generation_defaults.py; {} with vllm's)."""
        defaults = getattr(self.engine, "generation_defaults", None)
        return dict(defaults.sampling) if defaults is not None else {}

    @property
    def metrics(self):
        return self.engine.metrics

    @property
    def input_processor(self):
        return self.engine.input_processor

    async def on_input_thread(self, fn: Callable, *args):
        """Run fn(*args) on the input thread (tokenization, chat templates, validation) and return its result."""
        return await asyncio.get_running_loop().run_in_executor(self._input_thread, functools.partial(fn, *args))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> dict:
        """Last snapshot taken on the engine thread (refreshed after every step and every command batch)."""
        return dict(self._stats)

    def num_in_flight(self) -> int:
        """Requests accepted or queued for acceptance and not finished yet (any thread)."""
        with self._cond:
            return self._pending_adds + len(self._streams)

    # ---- graceful shutdown: drain, wait until num_in_flight() is 0, abort_all what is left ----
    def drain(self) -> None:
        """Refuse new requests (EngineDraining), let those in flight go on; only sets a flag (signal-safe)."""
        self.draining = True

    def abort_all(self, error: EngineError) -> None:
        """End every request in flight with `error` (their streams raise it) and free their KV blocks."""
        self._submit(("fail_all", error))

    # ---- lifecycle ----
    def start(self, build: Callable[[], object] | None = None):
        """Start the engine thread. Without `build`: returns self. With `build`: the thread first calls it, takes
        the engine from the result's `.engine` (an ElasticModel's), and `start` returns that result once it is
        built, or raises what `build` raised (then no thread is left running)."""
        if self._thread is not None and self._thread.is_alive():
            if build is not None:
                raise RuntimeError("the engine thread is already running; build must come with the first start()")
            return self
        if build is None and self.engine is None:
            raise ValueError("AsyncEngine has no engine: pass one to the constructor or give start() a build")
        self._stopping = False
        built: dict = {}
        ready = threading.Event()

        def run() -> None:
            if build is not None:
                try:
                    built["result"] = result = build()
                    self.engine = result.engine
                    self._refresh_stats()
                except BaseException as exc:  # handed to start()'s caller
                    built["error"] = exc
                    ready.set()
                    return
            ready.set()
            self._run()

        self._thread = threading.Thread(target=run, name=self._name, daemon=True)
        self._thread.start()
        if build is None:
            return self
        ready.wait()
        if "error" in built:
            self._thread.join()
            self._thread = None
            raise built["error"]
        return built["result"]

    def shutdown(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        self._thread = None

    # ---- request API (any thread with a running event loop) ----
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{self._id_prefix}-{next(self._ids)}"

    async def add_request(self, prompt: str | list[int], params: SamplingParams,
                          request_id: str | None = None, arrival_time: float | None = None) -> RequestStream:
        """Queue a request and wait until the engine accepted it. Raises ValueError for bad input (from
        `LLMEngine.add_request`), EngineDeadError when the engine is not running."""
        ids = [request_id] if request_id else None
        return (await self.add_requests([prompt], params, ids, arrival_time))[0]

    async def add_requests(self, prompts: list[str | list[int]], params: SamplingParams,
                           request_ids: list[str] | None = None, arrival_time: float | None = None
                           ) -> list[RequestStream]:
        """All-or-nothing: queue every prompt in one command batch (so they join the same step instead of one
        step each), wait for all acceptances; if any is refused, abort the accepted ones and raise its error."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        if self.draining:
            raise EngineDraining(f"the server is shutting down and takes no new requests "
                                 f"({self.num_in_flight()} still running); retry on another replica")
        loop = asyncio.get_running_loop()
        request_ids = request_ids or [self.new_request_id() for _ in prompts]
        arrival_time = time.time() if arrival_time is None else arrival_time
        processor = self.input_processor
        # Every prompt validated (InvalidRequest, a ValueError) and tokenized before anything is queued.
        requests = await self.on_input_thread(
            lambda: [processor.process(prompt, params, rid, arrival_time) for prompt, rid in zip(prompts, request_ids)])
        # counted from `arrival_time` on the monotonic clock, so a wall-clock jump neither expires nor extends it
        deadline = self.request_timeout and time.monotonic() + self.request_timeout - (time.time() - arrival_time)
        streams = [StreamQueue(rid, loop, accepted=loop.create_future(), deadline=deadline) for rid in request_ids]
        with self._cond:
            self._commands.extend(("add", st, request) for st, request in zip(streams, requests))
            self._pending_adds += len(streams)
            self._cond.notify()
        try:
            results = await asyncio.gather(*(st.accepted for st in streams), return_exceptions=True)
        except asyncio.CancelledError:
            for st in streams:  # accepted or not, do not leave them running for nobody
                self.abort(st.request_id)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for st, result in zip(streams, results):
                if result is None:
                    self.abort(st.request_id)
            raise errors[0]
        return [RequestStream(self, st) for st in streams]

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come. ValueError for bad input surfaces at the first iteration;
        stopping the iteration early aborts the request and frees its blocks."""
        stream = await self.add_request(prompt, params, request_id)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        """Thread-safe, idempotent; a no-op for unknown or finished requests."""
        self._submit(("abort", request_id))

    def wake(self) -> None:
        """Make an idle engine thread re-check `has_unfinished_requests()`: for components (the morph
        manager) that give the engine work of their own from another thread."""
        with self._cond:
            self._cond.notify()

    async def call(self, fn, *args, **kwargs):
        """Run `fn(*args, **kwargs)` on the engine thread between two steps and return its result (or raise its
        exception): the way to touch engine or model state safely while requests are in flight."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        self._submit(("call", loop, future, fn, args, kwargs))
        return await future

    # ---- engine thread ----
    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _run(self) -> None:
        log.info("engine thread started")
        while True:
            with self._cond:
                while not self._commands and not self._stopping and not self._has_work():
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                self._execute(command)
            with self._cond:  # after the adds entered `_streams`, so num_in_flight never misses one in between
                self._pending_adds -= sum(1 for command in commands if command[0] == "add")
            if stopping:
                break
            if self.request_timeout is not None:
                self._expire_overdue()
            if self._has_work():
                self._step()
            self._refresh_stats()
        self._fail_all(EngineDeadError("the engine shut down before the request finished"), include_pending=True)
        log.info("engine thread stopped")

    def _has_work(self) -> bool:
        try:
            return self.engine.has_unfinished_requests()
        except Exception:  # a broken engine must not wedge the loop
            log.exception("has_unfinished_requests failed")
            return False

    def _execute(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, request = command
            if self._stopping:
                stream.resolve(EngineDeadError("the engine is shutting down"))
                return
            try:
                self.engine.add_request(stream.request_id, request)
            except (ValueError, EngineOverloaded) as exc:  # the caller's to handle; nothing changed
                stream.resolve(exc)
                return
            except Exception as exc:
                log.exception("add_request(%s) failed", stream.request_id)
                stream.resolve(EngineError(f"engine failed to add the request: {exc}"))
                return
            self._streams[stream.request_id] = stream
            stream.resolve(None)
        elif kind == "abort":
            request_id = command[1]
            stream = self._streams.pop(request_id, None)
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%s) failed", request_id)
            if stream is not None:
                stream.finished = True
        elif kind == "fail_all":
            self._fail_all(command[1])
        elif kind == "call":
            _, loop, future, fn, args, kwargs = command
            try:
                result, error = fn(*args, **kwargs), None
            except Exception as exc:  # handed to the caller, not fatal to the loop
                result, error = None, exc

            def _settle():
                if not future.done():
                    future.set_exception(error) if error is not None else future.set_result(result)
            try:
                loop.call_soon_threadsafe(_settle)
            except RuntimeError:
                pass

    def _step(self) -> None:
        steps_before = self.engine.num_steps
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # The batch state is unknown after a failed step: fail every in-flight request (each gets a 500),
            # abort them in the engine so their blocks come back, and keep serving new requests.
            self._num_step_errors += 1
            self._consecutive_step_errors += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
            log.exception("engine step failed; failing %d in-flight requests", len(self._streams))
            self._fail_all(EngineError(f"engine step failed: {self._last_error}"))
            return
        if self.engine.num_steps != steps_before:
            self._consecutive_step_errors = 0
        elif not outputs:
            # Nothing was schedulable (e.g. every request waits for blocks): wait for a command instead of
            # spinning; the timeout retries in case the engine frees blocks on its own.
            with self._cond:
                if not self._commands and not self._stopping:
                    self._cond.wait(0.01)
            return
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            # A request the engine failed alone (its sampling raised) ends its stream with the error.
            delivered = stream.put(EngineError(f"request {out.request_id} failed: {out.error}") if out.error else out)
            if out.finished:
                self._streams.pop(out.request_id, None)
                stream.finished = True
            elif not delivered:
                self._streams.pop(out.request_id, None)
                self._safe_abort(out.request_id)

    def _fail_all(self, exc: BaseException, *, include_pending: bool = False) -> None:
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self._safe_abort(request_id)
            stream.put(exc)
        if include_pending:  # at shutdown nobody will execute the queued adds
            with self._cond:
                pending, self._commands = self._commands, []
                self._pending_adds = 0
            for command in pending:
                if command[0] == "add":
                    command[1].resolve(exc)
                elif command[0] == "call":
                    _, loop, future, *_ = command
                    try:
                        loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_exception(exc))
                    except RuntimeError:
                        pass

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        for request_id, stream in list(self._streams.items()):
            if stream.deadline is not None and now >= stream.deadline:
                del self._streams[request_id]
                self._safe_abort(request_id)
                stream.finished = True
                stream.put(RequestTimedOut(f"request aborted after the {self.request_timeout:g} s request timeout"))

    def _safe_abort(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            log.exception("abort_request(%s) failed", request_id)

    def _refresh_stats(self) -> None:
        try:
            stats = dict(self.engine.stats())
        except Exception as exc:
            stats = {"error": str(exc)}
        stats["num_streams"] = len(self._streams)
        stats["num_step_errors"] = self._num_step_errors
        stats["consecutive_step_errors"] = self._consecutive_step_errors
        self._stats = stats   # the error text stays in the log: /health, which anyone may read, shows counts only

    @property
    def healthy(self) -> bool:   # what /health reports
        return self.is_running and self._consecutive_step_errors < UNHEALTHY_AFTER_FAILED_STEPS
