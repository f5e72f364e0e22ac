"""A restore's weights loaded beside the steps (KunServe §4.4), so the restore's stop-the-world part is the KV
migration alone.

When the arbiter decides to restore a dropped layout, the pipeline keeps serving while every worker loads, on a
thread of its own, the layers it holds in the configured layout and not now (worker_reshape.prewarm, from the
shared host store). Their pages come from free KV blocks only: each instance's KV manager gives back enough free
blocks for its workers' missing layers first (never a live block; if the free blocks do not cover it, no prewarm,
and the restore runs as one blocking reshape). Each worker's progress comes back with its pipeline steps' stats; once
all are loaded (or after STALE_BOUNDARIES step boundaries, or when nothing steps) the control plane commits the
restore, whose prepare phase finds the layers in place. Another reshape first gives the loaded layers back
(`cancel`)."""
from __future__ import annotations

import logging
import time

from elastic_hf.topology import Topology
from elastic_hf.units import ceil_div

log = logging.getLogger(__name__)

STALE_BOUNDARIES = 16   # commit the restore anyway (its prepare joins whatever is still loading)
SPARE_BLOCKS = 2        # blocks share pages at their ends: a couple more than the bytes say


class RestorePrewarm:
    def __init__(self, deployment, shrunk: list[tuple[object, int]], loading: list[int]):
        self.dep = deployment
        self.workers = list(range(deployment.config.num_workers))
        self.shrunk = shrunk                 # (KV manager, blocks given back) per instance
        self.loading = loading               # the workers that load layers
        self.done: set[int] = set()
        self.boundaries = 0
        self.started = time.perf_counter()

    @classmethod
    def start(cls, deployment, target: Topology) -> "RestorePrewarm | None":
        """Free KV blocks for the missing layers and start the loads; None when the free blocks do not cover them
        (nothing is left changed then)."""
        pool, workers = deployment.pool, list(range(deployment.config.num_workers))
        footprints = pool.call_many(workers, "reshape_footprint", deployment.topology, target)
        reports = deployment.memory_report()
        need = {w: f["weights_after_bytes"] - r["weights_bytes"] - (r["free_bytes"] - r["headroom_bytes"])
                for w, f, r in zip(workers, footprints, reports)}
        shrunk: list[tuple[object, int]] = []
        for inst in deployment.instances:
            blocks = max((ceil_div(need[w], reports[w]["kv_block_bytes"]) + SPARE_BLOCKS
                          for w in inst.workers if need[w] > 0 and reports[w]["kv_block_bytes"]), default=0)
            if blocks == 0:
                continue
            kv = inst.engine.scheduler.kv
            given = len(kv.shrink(blocks))
            shrunk.append((kv, given))
            if given < blocks:
                log.info("no restore prewarm: instance %s has %d free KV blocks, its layers need %d",
                         inst.workers, given, blocks)
                cls._give_back(shrunk)
                return None
        loading = [w for w, started in zip(workers, pool.call_many(workers, "reshape.prewarm", target)) if started]
        if not loading:
            cls._give_back(shrunk)
            return None
        log.info("restore prewarm: loading the layers of %s beside the steps (%d KV blocks given back)", target,
                 sum(n for _, n in shrunk))
        return cls(deployment, shrunk, loading)

    def note(self, worker: int, report: dict | None) -> None:
        """A worker's load state as its pipeline step returned it (None: a step that ended before the load began,
        with cross-step pipelining, or a worker replaced since)."""
        if report is not None and report["done"]:
            self.done.add(worker)

    def poll(self, idle: bool) -> bool:
        """At a step boundary: whether the restore may commit now."""
        self.boundaries += 1
        if idle:
            for w, report in zip(self.loading, self.dep.pool.call_many(self.loading, "reshape.prewarm_report")):
                self.note(w, report if report is not None else {"done": True})
        return self.done.issuperset(self.loading) or self.boundaries >= STALE_BOUNDARIES

    def cancel(self) -> None:
        """Another reshape comes first: the workers give the loaded layers back, the KV managers their blocks."""
        self.dep.pool.call_many(self.workers, "reshape.drop_prewarm")
        self.give_back()

    def give_back(self) -> None:
        """The KV managers grow back by the blocks they gave (the layers' pages are free again)."""
        self._give_back(self.shrunk)
        self.shrunk = []

    def summary(self) -> dict:
        return {"prewarm_seconds": round(time.perf_counter() - self.started, 4), "prewarm_boundaries": self.boundaries,
                "prewarm_kv_blocks_given": sum(n for _, n in self.shrunk)}

    @staticmethod
    def _give_back(shrunk: list[tuple[object, int]]) -> None:
        for kv, n in shrunk:
            if n:
                kv.grow(n)
