"""A worker's part of a coordinated KV exchange (KunServe §4.2): after a parameter drop commits, the KV of running
requests for layers now owned by a peer is sent, not recomputed. It moves in chunks (kv/exchange_schedule.py): the
new pool's pages for a chunk's destination blocks are committed just before it and the old pool's (all layers of the
requests this worker ran) for the blocks it read last go back just after it, so the member never holds both pools
whole; the old pool is closed when the exchange ends.

The transfer runs on a thread of its own, concurrently with the steps the main thread keeps running for the queued
requests (the steps never touch the parked requests' blocks, the only rows the exchange writes), over a process group of
its own (parallel/groups.py), each chunk last layer first. While a step runs, the thread holds itself to `cpu_share` of
one core: after a layer that took t seconds of its CPU time it sleeps t * (1 - share) / share, so the step keeps the
rest of the core; with no step running it moves at full speed. A pipeline step may carry a new share (`set_cpu_share`:
OverloadConfig.exchange_cpu_share_queued while requests queue). Each pipeline step returns `report()` with its stage
stats (an idle deployment asks `progress`), and the control plane calls `finish` once every worker is done, which
returns the rest of the old pool's pages to the budget (the instance's KV manager then grows its serving pool into them;
`room_blocks` says how far, less what the chunks still commit while the exchange runs). Reached as "exchange.<method>"
through the worker's RPC."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time

from elastic_hf.kv.exchange_schedule import ExchangeChunk, exchange_peak_bytes, exchange_schedule
from elastic_hf.kv.migration_plan import KVTransfer
from elastic_hf.parallel.kv_migration import migrate_kv

log = logging.getLogger(__name__)

ABORT_JOIN_S = 10.0   # an aborted exchange's thread is waited for this long (its peer's death fails its transfer)


def _warm_up() -> None:
    """The ops of a transfer, once on tiny tensors (see KVExchangeParticipant.__init__)."""
    import torch

    rows = torch.zeros(4, 2)
    rows.index_copy_(0, torch.arange(2), rows.index_select(0, torch.arange(2, 4)))


class ExchangeStopped(Exception):
    """The control plane abandoned the exchange (a group member died)."""


class KVExchangeParticipant:
    def __init__(self, worker):
        self.worker = worker
        self._transfers: list[KVTransfer] | None = None
        self._chunks: list[ExchangeChunk] = []
        self._reserved_bytes = 0   # what the chunks still commit beyond what the pools hold at the start
        self._src = self._dst = None
        self._src_head = self._dst_head = 0
        self._fault_after_layers: int | None = None
        self._started = False              # an exchange was started and not yet finished or aborted
        self._idle = threading.Event()     # the thread has no exchange to move (set: done or never started)
        self._idle.set()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # One thread for the worker's life, started here: its stack, malloc arena and torch's thread-local state are
        # part of the worker's footprint from the start, not RSS that appears at a drop's commit point.
        threading.Thread(target=self._serve, name=f"elastic-hf-kv-exchange-{worker.me}", daemon=True).start()
        self._stop = threading.Event()
        self._full_speed = threading.Event()
        self._cpu_share = 1.0
        self._progress = {"layers": 0, "seconds": 0.0, "paced_seconds": 0.0, "sent_bytes": 0, "received_bytes": 0,
                          "local_bytes": 0}
        self._error: str | None = None
        self._close_source = True

    @property
    def in_flight(self) -> bool:
        return self._transfers is not None

    def begin(self, transfers: list[KVTransfer], src_pool, src_head_start: int, dst_pool,
              dst_head_start: int, close_source: bool = True, chunks: list[ExchangeChunk] | None = None) -> None:
        """Called at the commit point of a deferred-KV plan: src_pool is the old pool (or the kept pool itself),
        dst_pool the pool the worker now serves from. Nothing moves before `start`. close_source=False: src_pool
        still serves (a restore's KV copied ahead of its commit, restore_prewarm.py) and outlives the exchange.
        chunks: this worker's part of the plan's exchange_schedule, whose destination blocks dst_pool attached
        without committing them (a parameter drop): each chunk commits its own, and the old pool gives back the
        blocks it read last; None: one chunk into a committed pool."""
        me = self.worker.me
        if self._transfers is not None:
            raise RuntimeError(f"worker {me} already has a KV exchange in flight")
        self._transfers = [t for t in transfers if me in (t.src_worker, t.dst_worker)]
        self._chunks = chunks if chunks is not None else exchange_schedule(self._transfers, me, 1, False)
        self._src, self._src_head, self._dst, self._dst_head = src_pool, src_head_start, dst_pool, dst_head_start
        self._close_source = close_source
        self._reserved_bytes = 0
        if chunks is not None and src_pool is not None and dst_pool is not None:
            page = dst_pool.arena.page_size
            peak = exchange_peak_bytes(chunks, src_pool.attached_ids(), src_pool.layout.block_bytes,
                                       dst_pool.layout.block_bytes, page)
            self._reserved_bytes = max(0, peak - src_pool.committed_bytes)

    def arm_fault(self, after_layers: int | None) -> None:
        """End this process after `after_layers` more layers of the exchange (a failure drill: a group member dies
        mid-exchange)."""
        self._fault_after_layers = after_layers

    def start(self, cpu_share: float) -> None:
        """Start moving every transfer's share, last layer first, beside the steps (every worker of the exchange
        starts, so the point-to-point ops of each layer pair up)."""
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {cpu_share}")
        if self._started:
            raise RuntimeError(f"worker {self.worker.me}: the KV exchange already started")
        self._cpu_share = cpu_share
        self._stop.clear()
        self._full_speed.clear()
        self._error = None
        self._progress = dict.fromkeys(self._progress, 0)
        self._started = True
        self._idle.clear()
        self._jobs.put(self._run)

    def set_cpu_share(self, cpu_share: float) -> None:
        """The cap from the next layer on (a step of the exchange's pipeline carries it, parallel/worker.py)."""
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share must be in (0, 1], got {cpu_share}")
        self._cpu_share = cpu_share

    def _serve(self) -> None:
        _warm_up()
        while True:
            job = self._jobs.get()
            try:
                job()
            finally:
                self._idle.set()

    def _run(self) -> None:
        if not self._transfers:   # not part of this exchange's transfers (e.g. a kept peer with none)
            return
        group = self.worker.groups.exchange
        after_layer = self._after_layer(time.perf_counter())
        moved = dict.fromkeys(("sent_bytes", "received_bytes", "local_bytes"), 0)   # by the chunks before
        try:
            for chunk in self._chunks:
                if chunk.commit_blocks:
                    self._dst.commit_blocks(chunk.commit_blocks)
                stats = migrate_kv(chunk.transfers, self.worker.me, self._src, self._src_head, self._dst,
                                   self._dst_head, group=group,
                                   after_layer=lambda s: after_layer({k: moved[k] + s[k] for k in moved}))
                for key in moved:
                    moved[key] += stats[key]
                if chunk.release_blocks:
                    self._src.detach_blocks(list(chunk.release_blocks))   # their pages go back to the budget
        except ExchangeStopped:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported through progress(); the control plane recovers
            log.error("worker %d: KV exchange failed: %s", self.worker.me, exc)
            self._error = f"{type(exc).__name__}: {exc}"

    def _after_layer(self, started: float):
        # CPU time of this thread, not wall time: a layer's wall time includes waiting for a peer that is itself
        # pausing, and pacing on it would compound the peers' pauses layer after layer.
        layer_started = [started, time.thread_time(), self.worker.steps_started]

        def after_layer(stats: dict) -> None:
            now, cpu = time.perf_counter(), time.thread_time()
            progress = self._progress
            progress["layers"] += 1
            progress["seconds"] += now - layer_started[0]
            for key in ("sent_bytes", "received_bytes", "local_bytes"):
                progress[key] = stats[key]
            if self._fault_after_layers is not None:
                if self._fault_after_layers == 0:
                    os._exit(18)   # a real process death mid-exchange
                self._fault_after_layers -= 1
            stepped = self.worker.in_step or self.worker.steps_started != layer_started[2]
            if stepped and self._cpu_share < 1 and not self._full_speed.is_set():
                pause = (cpu - layer_started[1]) * (1 - self._cpu_share) / self._cpu_share
                self._full_speed.wait(pause)   # wakes early when the control plane waits for the end
                progress["paced_seconds"] += time.perf_counter() - now
            if self._stop.is_set():
                raise ExchangeStopped
            layer_started[:] = [time.perf_counter(), time.thread_time(), self.worker.steps_started]
        return after_layer

    def report(self) -> dict | None:
        """Where this worker's part stands (None: no exchange started): done, layers moved, seconds of transfer
        work, bytes, the error of a failed transfer. Every pipeline step returns it with its stage stats."""
        if not self._started:
            return None
        return {"done": self._idle.is_set(), "error": self._error, "cpu_share": self._cpu_share, **self._progress}

    def progress(self) -> dict:
        """report() as an RPC (an idle deployment asks): raises when the transfer failed (the control plane then
        checks the group's health and recovers)."""
        if self._error is not None:
            raise RuntimeError(f"worker {self.worker.me}: KV exchange failed: {self._error}")
        return self.report() or {"done": True, **self._progress}

    def wait(self) -> dict:
        """Move the rest at full speed and return when this worker's part is done (before a reshape or restore)."""
        self._full_speed.set()
        self._idle.wait()
        return self.progress()

    def finish(self) -> dict:
        """The exchange is over: the old pool's pages go back to the budget. Returns how many more KV blocks the
        budget now lets the serving pool attach."""
        self.wait()
        self._release_source()
        return {"room_blocks": self.room_blocks(), **self.worker.memory_report()}

    @property
    def busy(self) -> bool:
        """The thread is still inside a transfer."""
        return not self._idle.is_set()

    def stop(self) -> None:
        """Stop after the current layer (every worker of the exchange first, then `abort` on each: the layers' sends
        and receives pair up, so a worker told later would start a layer its stopped peer never posts)."""
        self._stop.set()
        self._full_speed.set()

    def abort(self) -> None:
        """A group member died mid-exchange: the KV in transit is dropped (its requests are recomputed)."""
        self.stop()
        if not self._idle.wait(ABORT_JOIN_S):   # still inside a transfer: its buffers must outlive it
            log.error("worker %d: the KV exchange thread did not stop within %.0f s; its old pool is kept",
                      self.worker.me, ABORT_JOIN_S)
            self._transfers, self._started = None, False
            return
        self._release_source()

    def _release_source(self) -> None:
        if self._src is not None and self._src is not self._dst and self._close_source:
            self._src.arena.close()
        lazy = [b for c in self._chunks for b in c.commit_blocks]
        if lazy and not self._dst.arena.closed:
            # An exchange stopped short left later chunks' blocks uncommitted: their requests are recomputed
            # into them, so they are committed now (the old pool's pages went back first).
            self._dst.commit_blocks([b for b in lazy if self._dst.is_attached(b)])
        self._chunks, self._reserved_bytes = [], 0
        self._transfers = None
        self._started = False
        self._src = self._dst = None

    # ------------------------------------------------------------------ room for the serving pool
    def room_blocks(self) -> int:
        """Blocks the serving pool could attach now: what the budget has free beyond the morph headroom (the old
        pool's live blocks still count while an exchange runs), at most the pool's reserved slots."""
        worker = self.worker
        pool = worker.pool
        if pool is None:
            return 0
        free = worker.budget.free_bytes - worker.instance.headroom_bytes - self._reserved_bytes
        return pool.attachable_within(free)
