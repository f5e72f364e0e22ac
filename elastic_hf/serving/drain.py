"""Graceful shutdown of `elastic-hf serve`. The first SIGTERM or SIGINT starts a drain: the engine takes no new
request (a new one gets HTTP 503 with Retry-After, code "server_draining"), /health answers 503 "draining" so load
balancers take the server out, and the requests in flight run to completion for up to the shutdown timeout. Those
still running then end with an error (a stream gets an SSE error event and `data: [DONE]`, a plain request an
error body), and only then does uvicorn shut down; the caller stops the engine and the worker processes after it.
A second signal exits at once.

uvicorn's own signal handler sets `should_exit` at the first signal, which closes the listening socket at once (new
clients would get "connection refused", not a 503), gives open connections only `timeout_graceful_shutdown`, and
re-raises the signal after `serve()` returns: a SIGTERM then kills the process before the engine and the worker
processes are stopped. `DrainingServer` replaces that handler and runs the drain from uvicorn's 10 Hz main-loop
check (`on_tick`), so uvicorn's shutdown starts only once nothing is left to wait for."""
from __future__ import annotations

import asyncio
import logging

import uvicorn

from elastic_hf.engine.async_engine import AsyncEngine
from elastic_hf.engine.errors import EngineDeadError

log = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0   # Kubernetes' default grace period between SIGTERM and SIGKILL
POLL_S = 0.05                       # requests finish at step granularity: tens of ms at best
ABORT_GRACE_S = 10.0                # the engine thread ends the leftovers between two steps; one step is far less


class Drain:
    """The drain of one AsyncEngine. Its state is the engine's `draining` flag (set once, never cleared), so the
    routes refusing new requests, /health and this object read the same fact."""

    def __init__(self, async_engine: AsyncEngine, timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S):
        if timeout_s < 0:
            raise ValueError(f"the shutdown timeout must be >= 0 seconds, got {timeout_s}")
        self.async_engine = async_engine
        self.timeout_s = timeout_s

    @property
    def draining(self) -> bool:
        return self.async_engine.draining

    def begin(self) -> None:
        """Refuse new requests from now on. Only sets a flag, so a signal handler may call it."""
        self.async_engine.drain()

    async def run(self) -> int:
        """Drain: wait up to the timeout for the requests in flight, then end the rest with an error.
        Returns how many had to be ended."""
        self.begin()
        loop = asyncio.get_running_loop()
        started = loop.time()
        log.warning("draining: %d request(s) in flight finish within %g s, new ones get 503",
                    self.async_engine.num_in_flight(), self.timeout_s)
        if await self.wait_idle(self.timeout_s):
            log.warning("drained in %.1f s", loop.time() - started)
            return 0
        unfinished = self.async_engine.num_in_flight()
        log.warning("shutdown timeout of %g s passed with %d request(s) unfinished: ending them",
                    self.timeout_s, unfinished)
        self.async_engine.abort_all(EngineDeadError(f"the server shut down before the request finished: its "
                                                    f"{self.timeout_s:g} s shutdown timeout passed"))
        if not await self.wait_idle(ABORT_GRACE_S):
            log.error("%d request(s) still in flight %g s after they were ended",
                      self.async_engine.num_in_flight(), ABORT_GRACE_S)
        return unfinished

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight, False when `timeout_s` passed first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.async_engine.num_in_flight():
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(POLL_S)
        return True


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining before its shutdown: the first SIGTERM/SIGINT begins `drain`, uvicorn exits
    once the drain is over (its listening socket stays open meanwhile, so new clients get a 503, not a refused
    connection); a second signal is uvicorn's forced exit (`forced` then tells the caller)."""

    def __init__(self, config: uvicorn.Config, drain: Drain):
        super().__init__(config)
        self.drain = drain
        self.drain_requested = False
        self.forced = False
        self.unfinished = 0          # requests the drain had to end with an error
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig, frame) -> None:
        # Runs as a signal handler between two bytecodes of the event loop's thread: flags only, no locks, no I/O.
        # Not calling uvicorn's handler also keeps it from re-raising the signal once serve() returns.
        if not self.drain_requested:
            self.drain_requested = True
            self.drain.begin()
        else:
            self.forced = self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.drain_requested and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.drain.run())
        if self._drain_task is not None and self._drain_task.done() and not self.should_exit:
            try:
                self.unfinished = self._drain_task.result()
            except Exception:  # a failed drain must not keep the server up: shut down as uvicorn would
                log.exception("drain failed; shutting down")
            self.should_exit = True
        return await super().on_tick(counter)
