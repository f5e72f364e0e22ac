"""The control plane's side of a coordinated KV exchange (KunServe §4.2), started by a parameter drop's commit.

The requests whose KV must move wait in the `exchanging` state (they hold their new blocks, the scheduler skips
them) while the queued requests already run on the new pipeline with the blocks the budget allows now. Between two
steps the exchange moves one chunk of layers, sized so that a chunk takes about one pipeline stage's execution time
(the paper's rule; on CPU this caps the exchange's CPU time per step), so activation transfers never wait behind a
long KV transfer. When the last chunk lands, the old pools are closed, their pages become KV blocks and the parked
requests resume with nothing recomputed."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

MIN_CHUNK_TARGET_S = 0.005   # a chunk is never sized below this (per-call overhead would dominate)
IDLE_CHUNK_TARGET_S = 0.25   # with nothing else to run, larger chunks: no step waits on them


@dataclass(slots=True)
class ExchangeStats:
    started: float
    num_parked_seqs: int
    chunks: int = 0
    sent_bytes: int = 0
    seconds: float = 0.0                       # summed over the chunks (the time steps were held back)
    chunk_layers: list[int] = field(default_factory=list)
    wall_seconds: float = 0.0                  # commit to the last chunk


class KVExchange:
    """One in-flight exchange over `workers` (every worker of the changed instances) for `num_layers` model layers,
    last layer first. `instances`: the serving instances whose engines hold parked requests and whose KV managers
    grow when the exchange ends."""

    def __init__(self, pool, workers: list[int], instances: list, num_layers: int, metrics=None):
        self.pool = pool
        self.workers = workers
        self.instances = instances
        self.next_end = num_layers
        self.chunk_layers = 1
        self.metrics = metrics
        parked = sum(len(i.engine.scheduler.exchanging) for i in instances)
        self.stats = ExchangeStats(time.perf_counter(), parked)
        self._grow(self.pool.call_many(workers, "exchange.room_blocks"))

    @property
    def done(self) -> bool:
        return self.next_end <= 0

    @property
    def num_parked(self) -> int:
        return sum(len(i.engine.scheduler.exchanging) for i in self.instances)

    def advance(self, target_s: float | None) -> bool:
        """Move one chunk of layers sized to `target_s` (one stage's execution time; None: no step is running, so
        a larger chunk delays nobody). Finishes the exchange after the last chunk; returns True then."""
        if self.done:
            return True
        target = max(target_s if target_s is not None else IDLE_CHUNK_TARGET_S, MIN_CHUNK_TARGET_S)
        start = max(0, self.next_end - self.chunk_layers)
        results = self.pool.call_many(self.workers, "exchange.run", start, self.next_end)
        seconds = max(r["seconds"] for r in results)
        sent = sum(r["sent_bytes"] for r in results)
        layers = self.next_end - start
        self.next_end = start
        self.stats.chunks += 1
        self.stats.sent_bytes += sent
        self.stats.seconds += seconds
        self.stats.chunk_layers.append(layers)
        if self.metrics is not None:
            self.metrics.on_exchange_chunk(sent, seconds)
        # Next chunk: as many layers as fit the target at this chunk's measured rate.
        per_layer = seconds / layers
        self.chunk_layers = max(1, int(target / per_layer) if per_layer > 0 else layers * 2)
        if self.done:
            self._finish()
        return self.done

    def run_to_end(self) -> None:
        """Finish now (before a reshape or a restore, which need the exchange settled)."""
        while not self.done:
            self.advance(None)

    def _finish(self) -> None:
        reports = self.pool.call_many(self.workers, "exchange.finish")
        self._grow([r["room_blocks"] for r in reports])
        resumed = sum(i.engine.scheduler.release_exchanging() for i in self.instances)
        self.stats.wall_seconds = time.perf_counter() - self.stats.started
        log.info("KV exchange done: %d chunks (%s layers), %.1f MiB sent, %.3f s of exchange in %.3f s; %d sequences "
                 "resumed", self.stats.chunks, self.stats.chunk_layers, self.stats.sent_bytes / 2 ** 20,
                 self.stats.seconds, self.stats.wall_seconds, resumed)

    def _grow(self, room: list[int]) -> None:
        """Each instance's KV manager grows by what every worker of the instance can hold now (its pools commit the
        blocks in the same call)."""
        by_worker = dict(zip(self.workers, room))
        for inst in self.instances:
            want = min(by_worker.get(w, 0) for w in inst.workers)
            if want > 0:
                inst.engine.scheduler.kv.grow(want)

    def abandon(self, survivors: list[int]) -> None:
        """A worker died mid-exchange: the survivors drop the KV in transit (the deployment recomputes the parked
        requests)."""
        for w in survivors:
            try:
                self.pool.call(w, "exchange.abort")
            except Exception as exc:   # noqa: BLE001 - best effort: recovery replaces what fails here
                log.error("worker %d could not abort its KV exchange: %s", w, exc)
        self.next_end = 0
