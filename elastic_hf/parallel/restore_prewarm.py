"""A restore's weights loaded beside the steps (KunServe §4.4), so the restore's stop-the-world part is the KV
migration alone.

When the arbiter decides to restore a dropped layout, the pipeline keeps serving while every worker loads, on a
thread of its own, the layers it holds in the configured layout and not now (worker_reshape.prewarm, from the
shared host store). Their pages come from free KV blocks only: each instance's KV manager gives back enough free
blocks for its workers' missing layers first (never a live block; if the free blocks do not cover it, no prewarm,
and the restore runs as one blocking reshape). Each worker's progress comes back with its pipeline steps' stats; once
all are loaded (or after STALE_BOUNDARIES step boundaries, or when nothing steps) the control plane commits the
restore, whose prepare phase finds the layers in place. Between the two, the running requests' full KV blocks are
copied into the restored layout's pools beside the steps (restore_precopy.py), so the commit moves only the blocks
written since. Another reshape first gives the loaded layers and the copies back (`cancel`)."""
from __future__ import annotations

import logging
import time

from elastic_hf.parallel import restore_precopy
from elastic_hf.topology import Topology

log = logging.getLogger(__name__)

STALE_BOUNDARIES = 16   # commit the restore anyway (its prepare joins whatever is still loading)


class RestorePrewarm:
    def __init__(self, deployment, target: Topology, shrunk: list[tuple[object, int]], loading: list[int],
                 footprints: list[dict], cpu_share: float = 1.0):
        self.dep = deployment
        self.target = target
        self.footprints = footprints         # each worker's reshape_footprint to target (the topology cannot change
        #                                      while the prewarm lives: any reshape cancels it first)
        self.workers = list(range(deployment.config.num_workers))
        self.shrunk = shrunk                 # (KV manager, blocks given back) per instance
        self.loading = loading               # the workers that load layers
        self.cpu_share = cpu_share           # of the KV pre-copy while steps run
        self.done: set[int] = set()          # loaded
        self.copied: set[int] = set()
        self.precopy = None                  # reshape.PreCopy once the KV copy started
        self.copying: list[int] = []         # the workers that copy
        self.copy_failed = False
        self.copy_blocks = 0
        self.copy_started: float | None = None
        self.boundaries = 0
        self.started = time.perf_counter()

    @classmethod
    def start(cls, deployment, target: Topology, cpu_share: float = 1.0) -> "RestorePrewarm | None":
        """Free KV blocks for the missing layers and start the loads; None when the free blocks do not cover them
        (nothing is left changed then)."""
        pool, workers = deployment.pool, list(range(deployment.config.num_workers))
        footprints = pool.call_many(workers, "reshape_footprint", deployment.topology, target)
        reports = deployment.memory_report()
        need = {w: f["weights_after_bytes"] - r["weights_bytes"] - (r["free_bytes"] - r["headroom_bytes"])
                for w, f, r in zip(workers, footprints, reports)}
        shrunk = restore_precopy.free_kv_blocks(deployment, need, reports, "restore prewarm")
        if shrunk is None:
            return None
        loading = [w for w, started in zip(workers, pool.call_many(workers, "reshape.prewarm", target)) if started]
        if not loading:
            restore_precopy.give_back(shrunk)
            return None
        log.info("restore prewarm: loading the layers of %s beside the steps (%d KV blocks given back)", target,
                 sum(n for _, n in shrunk))
        return cls(deployment, target, shrunk, loading, footprints, cpu_share)

    def note(self, worker: int, report: dict | None) -> None:
        """A worker's load (and copy) state as its pipeline step returned it (None: a step that ended before the
        load began, with cross-step pipelining, or a worker replaced since)."""
        if report is None:
            return
        if report["done"]:
            self.done.add(worker)
        if self.precopy is not None and report.get("copied"):
            self.copied.add(worker)
        if self.precopy is not None and report.get("copy_error"):
            self.copy_failed = True

    def poll(self, idle: bool) -> bool:
        """At a step boundary: whether the restore may commit now. Once every layer is loaded the KV pre-copy
        starts (restore_precopy.py); the commit waits for it to end, or for STALE_BOUNDARIES more boundaries."""
        self.boundaries += 1
        if idle:
            for w, report in zip(self.workers, self.dep.pool.call_many(self.workers, "reshape.prewarm_report")):
                self.note(w, report if report is not None else {"done": True, "copied": True})
        loaded = self.done.issuperset(self.loading)
        if loaded and self.copy_started is None:
            self.copy_started = time.perf_counter()
            started = restore_precopy.start_precopy(self.dep, self.target, self.cpu_share, self.footprints)
            if started is not None:
                self.precopy, shrunk, self.copy_blocks, self.copying = started
                self.shrunk.extend(shrunk)
                self.boundaries = 0
                return False
        if self.precopy is not None and self.copy_failed:   # the commit moves all the KV instead
            log.warning("restore KV pre-copy failed on a worker; the restore moves all the KV at its commit")
            self.abandon_copy([w for w in self.copying if w not in self.dep.pool.check_health()])
        if self.precopy is not None:
            return self.copied.issuperset(self.copying) or self.boundaries >= STALE_BOUNDARIES
        return loaded or self.boundaries >= STALE_BOUNDARIES

    def abandon_copy(self, survivors: list[int]) -> None:
        """A worker died: the copy stops (the restore, if it still happens, moves all the KV at its commit)."""
        if self.precopy is not None:
            restore_precopy.abandon(self.dep, survivors)
            self.precopy = None

    def cancel(self) -> None:
        """Another reshape comes first: the workers give the loaded layers back, the KV managers their blocks."""
        self.dep.pool.call_many(self.workers, "reshape.drop_prewarm")
        self.give_back()

    def give_back(self) -> None:
        """The KV managers grow back by the blocks they gave (the layers' pages are free again)."""
        restore_precopy.give_back(self.shrunk)
        self.shrunk = []

    def summary(self) -> dict:
        now = time.perf_counter()
        return {"prewarm_seconds": round(now - self.started, 4), "prewarm_boundaries": self.boundaries,
                "prewarm_kv_blocks_given": sum(n for _, n in self.shrunk),
                "precopy_blocks": self.copy_blocks if self.precopy is not None else 0,
                "precopy_seconds": round(now - self.copy_started, 4) if self.precopy is not None else 0.0}
