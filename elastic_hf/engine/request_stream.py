"""The asyncio side of one request in flight on AsyncEngine: `StreamQueue`, where the engine thread puts the
request's outputs (thread-safe, through the loop), and `RequestStream`, the async iterator a caller reads them
from, which aborts the request when the caller stops reading early."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elastic_hf.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from elastic_hf.engine.async_engine import AsyncEngine


@dataclass(slots=True)
class StreamQueue:
    """The asyncio side of one request: where the engine thread puts its outputs."""
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    accepted: asyncio.Future | None = None   # resolves once add_request ran on the engine thread
    finished: bool = False
    deadline: float | None = None            # time.monotonic() past which the request times out

    def put(self, item) -> bool:
        """Thread-safe put; False when the loop is gone (its consumer can never read again)."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # loop closed
            return False

    def resolve(self, exc: BaseException | None) -> None:
        def _set():
            if self.accepted is not None and not self.accepted.done():
                self.accepted.set_exception(exc) if exc is not None else self.accepted.set_result(None)
        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:
            pass


class RequestStream:
    """Async iterator over one accepted request's outputs; aborts the request if iteration stops early."""

    def __init__(self, owner: "AsyncEngine", stream: StreamQueue):
        self._owner = owner
        self._stream = stream
        self.request_id = stream.request_id

    def __aiter__(self):
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await self._stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            # Consumer went away (client disconnect, CancelledError, GeneratorExit, break): free its KV blocks now.
            if not finished:
                self._owner.abort(self.request_id)

    def abort(self) -> None:
        """For a stream that will never be iterated (e.g. a sibling prompt of the same HTTP request failed)."""
        self._owner.abort(self.request_id)
