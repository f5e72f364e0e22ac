"""A worker's part of a coordinated KV exchange (KunServe §4.2): after a parameter drop commits, the KV of running
requests for layers now owned by a peer is sent, not recomputed. The old pool (all layers of the requests this
worker ran) stays alive until the exchange ends; the control plane calls `run` with one chunk of layers between
pipeline steps, so activation transfers are never queued behind the exchange, then `finish`, which returns the old
pool's pages to the budget, which the instance's KV manager then grows its serving pool into (`room_blocks` says
how far). Reached as "exchange.<method>" through the worker's RPC."""
from __future__ import annotations

import time

from elastic_hf.kv.migration_plan import KVTransfer
from elastic_hf.parallel.kv_migration import migrate_kv


class KVExchangeParticipant:
    def __init__(self, worker):
        self.worker = worker
        self._transfers: list[KVTransfer] | None = None
        self._src = self._dst = None
        self._src_head = self._dst_head = 0
        self._fault_after_chunks: int | None = None

    @property
    def in_flight(self) -> bool:
        return self._transfers is not None

    def begin(self, transfers: list[KVTransfer], src_pool, src_head_start: int, dst_pool,
              dst_head_start: int) -> None:
        """Called at the commit point of a deferred-KV plan: src_pool is the old pool (or the kept pool itself),
        dst_pool the pool the worker now serves from."""
        if self._transfers is not None:
            raise RuntimeError(f"worker {self.worker.me} already has a KV exchange in flight")
        self._transfers = [t for t in transfers if self.worker.me in (t.src_worker, t.dst_worker)]
        self._src, self._src_head, self._dst, self._dst_head = src_pool, src_head_start, dst_pool, dst_head_start

    def arm_fault(self, after_chunks: int | None) -> None:
        """End this process after `after_chunks` more chunks (a failure drill: a group member dies mid-exchange)."""
        self._fault_after_chunks = after_chunks

    def run(self, layer_start: int, layer_end: int) -> dict:
        """Move every transfer's share of model layers [layer_start, layer_end), last layer first (every worker of
        the exchange runs the same range, so the point-to-point ops pair up)."""
        if self._fault_after_chunks is not None:
            if self._fault_after_chunks == 0:
                import os

                os._exit(18)   # a real process death mid-exchange
            self._fault_after_chunks -= 1
        if self._transfers is None:   # not part of this exchange's transfers (e.g. a kept peer with none)
            return {"seconds": 0.0, "sent_bytes": 0, "received_bytes": 0, "local_bytes": 0}
        started = time.perf_counter()
        stats = migrate_kv(self._transfers, self.worker.me, self._src, self._src_head, self._dst, self._dst_head,
                           (layer_start, layer_end))
        stats["seconds"] = time.perf_counter() - started
        return stats

    def finish(self) -> dict:
        """The exchange is over: the old pool's pages go back to the budget. Returns how many more KV blocks the
        budget now lets the serving pool attach."""
        self._release_source()
        return {"room_blocks": self.room_blocks(), **self.worker.memory_report()}

    def abort(self) -> None:
        """A group member died mid-exchange: the KV in transit is dropped (its requests are recomputed)."""
        self._release_source()

    def _release_source(self) -> None:
        if self._src is not None and self._src is not self._dst:
            self._src.arena.close()
        self._transfers = None
        self._src = self._dst = None

    # ------------------------------------------------------------------ room for the serving pool
    def room_blocks(self) -> int:
        """Blocks the serving pool could attach now: what the budget has free beyond the morph headroom (the old
        pool's live blocks still count while an exchange runs), at most the pool's reserved slots."""
        worker = self.worker
        pool = worker.pool
        if pool is None:
            return 0
        free = worker.budget.free_bytes - worker.instance.headroom_bytes
        return pool.attachable_within(free)
