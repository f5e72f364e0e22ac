"""The control plane's side of a coordinated KV exchange (KunServe §4.2), started by a parameter drop's commit.

The requests whose KV must move wait in the `exchanging` state (they hold their new blocks, the scheduler skips
them) while the queued requests already run on the new pipeline with the blocks the budget allows now. The KV moves
on a thread of each worker beside the steps, held to `cpu_share` of a core while a step runs
(parallel/worker_exchange.py). How far each worker is comes back with its pipeline steps' stage stats, so the control
plane never asks a worker that is busy with a batch still in flight (an RPC would wait for it and drain the
pipeline); it asks by RPC only when nothing is stepping, or when a worker has not reported for
`STALE_REPORT_BOUNDARIES` step boundaries. When every worker is done, the old pools are closed, their pages become
KV blocks and the parked requests resume with nothing recomputed."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

STALE_REPORT_BOUNDARIES = 16


@dataclass(slots=True)
class ExchangeStats:
    started: float
    num_parked_seqs: int
    layers: int = 0                # layers moved by the slowest worker so far
    sent_bytes: int = 0
    seconds: float = 0.0           # transfer work of the busiest worker (beside the steps, not in them)
    paced_seconds: float = 0.0     # time that worker held back for the steps (the CPU-share cap)
    polls: int = 0                 # step boundaries the exchange spanned
    queued_boundaries: int = 0     # of which with requests queued (the cap exchange_cpu_share_queued, if set)
    max_cpu_share: float = 0.0     # the highest cap a worker reported
    wall_seconds: float = 0.0      # commit to the end


class KVExchange:
    """One in-flight exchange over `workers` (every worker of the changed instances), last layer first.
    `instances`: the serving instances whose engines hold parked requests and whose KV managers grow when the
    exchange ends."""

    def __init__(self, pool, workers: list[int], instances: list, cpu_share: float, metrics=None):
        self.pool = pool
        self.workers = workers
        self.instances = instances
        self.metrics = metrics
        self.done = False
        self.reports: dict[int, dict] = {}   # the latest progress of each worker
        self._boundaries_since_report = dict.fromkeys(workers, 0)
        parked = sum(len(i.engine.scheduler.exchanging) for i in instances)
        self.stats = ExchangeStats(time.perf_counter(), parked)
        self._grow(self.pool.call_many(workers, "exchange.room_blocks"))
        try:
            self.pool.call_many(workers, "exchange.start", cpu_share)
        except RuntimeError as exc:
            dead = self.pool.check_health()
            if not dead:
                raise
            # A member's transfer thread can get far enough to die before its start RPC answers: the same death as
            # one mid-exchange, recovered the same way (the next step's health check replaces the worker and
            # abandons this exchange, OverloadControl.on_workers_lost; the parked requests are recomputed).
            log.warning("KV exchange: workers %s died as it started (%s); recovery takes over", dead, exc)

    @property
    def num_parked(self) -> int:
        return sum(len(i.engine.scheduler.exchanging) for i in self.instances)

    def note(self, worker: int, report: dict) -> None:
        """A worker's progress as its pipeline step returned it (called from the instances' step threads)."""
        self.reports[worker] = report
        self._boundaries_since_report[worker] = 0
        self.stats.max_cpu_share = max(self.stats.max_cpu_share, report.get("cpu_share", 0.0))

    def poll(self, idle: bool) -> bool:
        """At a step boundary: the workers' latest progress (asked by RPC when `idle`, i.e. no batch in flight, or
        when stale); finish the exchange when all are done (True then)."""
        if self.done:
            return True
        self.stats.polls += 1
        stale = [w for w, n in self._boundaries_since_report.items() if n >= STALE_REPORT_BOUNDARIES]
        failed = any(r.get("error") for r in self.reports.values())   # the RPC raises it as a WorkerError
        ask = self.workers if idle or failed else stale
        if ask:
            for w, report in zip(ask, self.pool.call_many(ask, "exchange.progress")):
                self.note(w, report)
        for w in self.workers:
            self._boundaries_since_report[w] += 1
        if len(self.reports) == len(self.workers):
            self._account(list(self.reports.values()))
            if all(r["done"] for r in self.reports.values()):
                self._finish()
        return self.done

    def run_to_end(self) -> None:
        """Finish now, the rest at full speed (before a reshape or a restore, which need the exchange settled)."""
        if not self.done:
            self._account(self.pool.call_many(self.workers, "exchange.wait"))
            self._finish()

    def _account(self, reports: list[dict]) -> None:
        busiest = max(reports, key=lambda r: r["seconds"])
        sent = sum(r["sent_bytes"] for r in reports)
        if self.metrics is not None:
            self.metrics.on_exchange_progress(sent - self.stats.sent_bytes, busiest["seconds"] - self.stats.seconds)
        self.stats.sent_bytes, self.stats.seconds = sent, busiest["seconds"]
        self.stats.paced_seconds = busiest["paced_seconds"]
        self.stats.layers = min(r["layers"] for r in reports)

    def _finish(self) -> None:
        reports = self.pool.call_many(self.workers, "exchange.finish")
        self.done = True
        self._grow([r["room_blocks"] for r in reports])
        resumed = sum(i.engine.scheduler.release_exchanging() for i in self.instances)
        self.stats.wall_seconds = time.perf_counter() - self.stats.started
        log.info("KV exchange done: %.1f MiB sent, %.3f s of transfer (+%.3f s paced for the steps) beside %d step "
                 "boundaries in %.3f s; %d sequences resumed", self.stats.sent_bytes / 2 ** 20, self.stats.seconds,
                 self.stats.paced_seconds, self.stats.polls, self.stats.wall_seconds, resumed)

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
        self.done = True
