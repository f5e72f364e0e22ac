"""A worker's part of a reshape transaction (Gyges §4, ReMP §3.9): three phases before the commit point, then commit
or abort. A worker's role is a TP shard (tp, rank) of a layer range (its pipeline stage; all layers outside a
pipeline): layers it stops holding are released first, layers it starts holding are loaded from the host store.
The control plane runs each phase on every worker and starts the next only when all succeeded, so no worker waits
in a transfer on a peer that already failed. Reached as "reshape.<phase>" through the worker's RPC."""
from __future__ import annotations

import logging
import os
import threading
import time

from elastic_hf.kv.exchange_schedule import exchange_schedule, lazy_blocks
from elastic_hf.kv.migration_plan import head_range
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.parallel.kv_migration import migrate_kv
from elastic_hf.parallel.reshape_plan import ReshapePlan
from elastic_hf.parallel.shard_transform import MLP_KINDS, gather_weights, weight_gather_plan

log = logging.getLogger(__name__)

RESHAPE_STAGES = ("weights_first", "kv_trim", "kv_migrate", "weights_last", "prepared")  # before the commit point
FAULT_STAGES = RESHAPE_STAGES + ("committed",)
RESHAPE_PHASES = ("reshape.prepare", "reshape.migrate_kv", "reshape.finish_weights")


class ReshapeParticipant:
    def __init__(self, worker):
        self.worker = worker
        self._txn: dict | None = None
        self._fault: tuple[str, bool] | None = None
        self._prewarm: _Preload | None = None
        self._prewarm_target = None   # the topology whose layers it loads
        self._precopy: tuple | None = None   # (topology, pool): a restore's KV copied ahead of its commit

    @property
    def _me(self) -> int:
        return self.worker.me

    def _check_fault(self, stage: str) -> None:
        if self._fault is None or self._fault[0] != stage:
            return
        _, kill = self._fault
        self._fault = None
        if kill:
            os._exit(17)  # a real process death, as a crash or an OOM kill would leave it
        raise RuntimeError(f"fault injected at reshape stage {stage!r} on worker {self._me}")

    def arm_fault(self, stage: str | None, kill: bool = False) -> None:
        """Make the next reshape fail at `stage` (one of FAULT_STAGES): raise, or with kill=True end the process.
        For transaction tests and failure drills."""
        if stage is not None and stage not in FAULT_STAGES:
            raise ValueError(f"stage must be one of {FAULT_STAGES}, got {stage!r}")
        self._fault = None if stage is None else (stage, kill)

    def _require_txn(self) -> dict:
        if self._txn is None:
            raise RuntimeError(f"worker {self._me} has no prepared reshape to commit")
        return self._txn

    # ------------------------------------------------------------------ a restore's weights, beside the steps
    def prewarm(self, topology) -> bool:
        """Start loading, on a thread beside the steps, the layers this worker holds in `topology` and not now (a
        restore after a parameter drop, KunServe §4.4): the restore's stop-the-world part is then the KV migration
        alone. The control plane freed budget for them first (free KV blocks given back). The layers stay inactive
        until a reshape switches to them (its prepare joins this) or `drop_prewarm` releases them. Returns whether
        a load started."""
        worker = self.worker
        role = worker.groups.for_topology(topology, self._me)
        if role is None or self._prewarm is not None or self._txn is not None:
            return False
        _, tp, rank = role
        self._prewarm = _Preload(worker.weights, tp, rank, worker.layer_range(topology))
        self._prewarm_target = topology
        return True

    def prewarm_report(self) -> dict | None:
        """None without a prewarm; else whether its load is done and, once a KV pre-copy started, whether that is
        (returned with every pipeline step's stats)."""
        if self._prewarm is None and self._precopy is None:
            return None
        copy = self.worker.exchange.report() if self._precopy is not None else None
        return {"done": self._prewarm is None or not self._prewarm.thread.is_alive(),
                "copied": None if copy is None else copy["done"], "copy_error": copy and copy["error"]}

    def precopy(self, topology, num_blocks: dict[int, int], transfers) -> dict:
        """Make the pool this worker serves from in `topology` (a restore's, with num_blocks[worker] blocks) and
        hand the exchange thread the copy of the running requests' full KV blocks into it; the control plane
        starts it ("exchange.start") once every worker of the copy got this far, so no worker waits in a transfer
        on a peer that never posts its side. A full block is never written again, so the restore's commit moves
        only the blocks that filled or began since (migrate_kv). The thread (worker_exchange.py) copies from the
        pool that keeps serving, over its own group, held to its CPU share while steps run."""
        worker = self.worker
        if self._precopy is not None or self._txn is not None or worker.exchange is None or worker.exchange.in_flight:
            raise RuntimeError(f"worker {self._me} cannot start a KV pre-copy now")
        new = worker.groups.for_topology(topology, self._me)
        old = worker.groups.for_topology(worker.topology, self._me)
        if new is None or old is None:
            raise RuntimeError(f"worker {self._me}: a KV pre-copy is for workers that serve before and after")
        num_kv_heads = worker.loaded.num_kv_heads
        pool = worker.instance.new_pool(new[1], new[2], num_blocks[self._me], worker.layer_range(topology))
        self._precopy = (topology, pool)
        worker.exchange.begin(transfers, worker.pool, head_range(num_kv_heads, old[1], old[2])[0], pool,
                              head_range(num_kv_heads, new[1], new[2])[0], close_source=False)
        return {"bytes": pool.num_blocks * pool.layout.block_bytes}

    def _take_precopy(self, topology) -> KVPagePool | None:
        """The pre-copied pool for `topology` once its copy is done (None: none); raises what the copy raised."""
        if self._precopy is None or self._precopy[0] != topology:
            return None
        pool = self._precopy[1]
        self._precopy = None
        try:
            self.worker.exchange.finish()   # the rest at full speed; the serving pool stays open
        except BaseException:
            pool.arena.close()
            raise
        return pool

    def drop_precopy(self, abort: bool = False) -> None:
        """The pre-copied pool goes, the serving one stays (abort: do not wait for a copy whose peer died)."""
        if self._precopy is None:
            return
        pool, self._precopy = self._precopy[1], None
        exchange = self.worker.exchange
        if abort:    # a peer of the copy died or failed: waiting for the rest would wait on it
            exchange.abort()
        else:
            try:
                exchange.finish()
            except RuntimeError as exc:
                log.warning("worker %d: the cancelled KV pre-copy had failed: %s", self._me, exc)
        if exchange.busy:   # still inside a transfer: its writes must keep landing in pages that are ours
            log.error("worker %d: the KV pre-copy thread did not stop; its pool is kept", self._me)
            return
        pool.arena.close()

    def drop_prewarm(self, abort: bool = False) -> dict:
        """The restore did not happen: the KV pre-copy's pool goes (abort: a peer died, do not wait for the copy),
        then wait for the load and give back every layer outside this worker's current range. Returns the bytes
        released."""
        self.drop_precopy(abort)
        if self._prewarm is None:
            return {"released_bytes": 0}
        self._prewarm.join(raise_error=False)
        self._prewarm = None
        start, end = self.worker.layer_range()
        outside = [i for i in range(self.worker.loaded.num_layers) if not start <= i < end]
        weights = self.worker.weights
        return {"released_bytes": weights.release_layers(outside) + weights.release_tables((start, end))}

    # ------------------------------------------------------------------ phases before the commit point
    def prepare(self, plan: ReshapePlan) -> dict:
        """Phase 1: scale-up releases the MLP shards it no longer owns (MLP first, so the freed pages can take the
        migrated KV, Gyges §4.3); the old pool decommits its unused blocks. A worker may be in standby before
        (wake-up) or after (it hands its KV over and gives its shard back at the commit point)."""
        worker = self.worker
        if self._txn is not None:
            raise RuntimeError(f"worker {self._me} already has a reshape in flight")
        if worker.morph is not None and not worker.morph.all_full_precision():
            raise RuntimeError(f"worker {self._me} has layers below full precision; a reshape needs them at fp")
        old_role, new_role = plan.old.role(self._me), plan.new.role(self._me)
        old = worker.groups.for_topology(plan.old, self._me)
        new = worker.groups.for_topology(plan.new, self._me)
        kept = plan.is_kept(self._me) or (old_role is None and new_role is None)
        old_layers, new_layers = worker.layer_range(plan.old), worker.layer_range(plan.new)
        prewarmed = None
        if self._prewarm is not None:   # a restore's weights loaded beside the steps: finished before anything moves
            if self._prewarm_target == plan.new:
                prewarmed, self._prewarm = self._prewarm.join(raise_error=False), None
            else:
                prewarmed = self.drop_prewarm()   # another reshape: the layers it loaded go back first
        if self._precopy is not None and self._precopy[0] != plan.new:
            self.drop_precopy()
        budget = worker.budget
        txn = {"plan": plan, "old": old, "new": new, "trimmed": [], "new_pool": None, "kept": kept,
               "old_layers": old_layers, "new_layers": new_layers,
               "stats": {"weights_bytes_before": budget.used_bytes("weights"),
                         "kv_bytes_before": budget.used_bytes("kv"), "kept": kept, "prewarmed": prewarmed}}
        self._txn = txn
        if kept:  # same instance before and after: shard, pool and groups stay; it may receive moved KV
            return txn["stats"]
        if old is not None and new is not None and new[1] > old[1]:
            layer_ids = [i for i in reversed(range(*old_layers)) if new_layers[0] <= i < new_layers[1]]
            txn["stats"]["weights_first"] = worker.weights.switch(MLP_KINDS, new[1], new[2], new[0], layer_ids)
        if old is not None and new is not None and old_layers != new_layers:
            # Layers this worker stops holding go first: their pages can take the KV and layers it receives.
            dropped = [i for i in range(*old_layers) if not new_layers[0] <= i < new_layers[1]]
            txn["stats"]["layers_released_bytes"] = worker.weights.release_layers(dropped) \
                + worker.weights.release_tables(new_layers)
        self._check_fault("weights_first")
        pool = worker.pool
        if pool is not None:
            # The old pool keeps its live blocks until the commit point (rollback needs them); the rest go back.
            txn["trimmed"].extend(pool.trim_to(set(plan.live_old_blocks[old_role[0]])))
        self._check_fault("kv_trim")
        return txn["stats"]

    def migrate_kv(self) -> dict:
        """Phase 2: a new pool for the new head range holds the live blocks (a kept instance receives into its own
        pool); KV moves by (block, head range), layer by layer."""
        worker = self.worker
        txn = self._require_txn()
        plan: ReshapePlan = txn["plan"]
        old, new = txn["old"], txn["new"]
        num_kv_heads = worker.loaded.num_kv_heads
        if txn["kept"]:
            if new is None:
                return {}
            h0 = head_range(num_kv_heads, new[1], new[2])[0]
            if plan.defer_kv:   # moved KV lands here during the exchange, after the commit point
                txn["exchange"] = (worker.pool, h0, worker.pool, h0)
                return {}
            kv = migrate_kv(plan.transfers, self._me, worker.pool, h0, worker.pool, h0)
            txn["stats"]["kv"] = {**kv, "new_pool_live_bytes": 0, "peak_extra_bytes": kv["peak_staging_bytes"]}
            return kv
        kv_before = worker.budget.used_bytes("kv")
        new_pool = self._take_precopy(plan.new)
        if plan.precopied and new is not None and new_pool is None:
            raise RuntimeError(f"worker {self._me} has no pre-copied KV pool for {plan.new}; the plan moves only the "
                               f"blocks written since the pre-copy")
        if new is not None:
            live = plan.num_live_new_blocks[plan.new.role(self._me)[0]]
            if new_pool is None and plan.defer_kv and old is not None and plan.exchange_chunks > 1:
                # The exchange commits the blocks it writes chunk by chunk, as the old pool gives its pages back
                chunks = txn["chunks"] = exchange_schedule(plan.transfers, self._me, plan.exchange_chunks)
                lazy = lazy_blocks(chunks)
                new_pool = txn["new_pool"] = worker.instance.new_pool(new[1], new[2], 0, txn["new_layers"])
                new_pool.attach_blocks(live, commit=False)
                new_pool.commit_blocks([b for b in range(live) if b not in lazy])
            elif new_pool is None:
                new_pool = worker.instance.new_pool(new[1], new[2], live, txn["new_layers"])
            elif live > new_pool.num_blocks:
                new_pool.attach_blocks(live - new_pool.num_blocks)
            txn["new_pool"] = new_pool
        old_h0 = head_range(num_kv_heads, old[1], old[2])[0] if old is not None else 0
        new_h0 = head_range(num_kv_heads, new[1], new[2])[0] if new is not None else 0
        if new is not None and plan.overlap_weights and plan.weights_source == "host":
            # The weights the new role needs come from the host store while the KV moves: the phase costs
            # max(T_kv, T_w), not the sum (ReMP §3.3). finish_weights joins it before switching.
            txn["preload"] = _Preload(worker.weights, new[1], new[2], txn["new_layers"])
        if plan.defer_kv:
            # A parameter drop: nothing moves before the commit point. The old pool keeps its live blocks and hands
            # them to the exchange (worker_exchange.py), which sends them on its own thread beside the steps.
            txn["exchange"] = (worker.pool, old_h0, new_pool, new_h0)
            self._check_fault("kv_migrate")
            return {"deferred": True}
        started = time.perf_counter()
        kv = migrate_kv(plan.transfers, self._me, worker.pool, old_h0, new_pool, new_h0)
        kv["seconds"] = time.perf_counter() - started
        kv["new_pool_live_bytes"] = worker.budget.used_bytes("kv") - kv_before
        kv["peak_extra_bytes"] = kv["new_pool_live_bytes"] + kv["peak_staging_bytes"]
        txn["stats"]["kv"] = kv
        self._check_fault("kv_migrate")
        return kv

    def finish_weights(self) -> dict:
        """Phase 3: attention (and, scaling down, the MLP after the KV) switch to the new shard; scale-down and
        wake-up load the chunks they now need from the shared host store or from peers. A worker going to
        standby keeps its shard until the commit point (rollback is then free)."""
        worker = self.worker
        txn = self._require_txn()
        new = txn["new"]
        stats = txn["stats"]
        plan: ReshapePlan = txn["plan"]
        if plan.weights_source == "peers":
            layouts = {kind: lin.layout for kind, lin in worker.weights.linears[0].items()}
            gather = weight_gather_plan(plan.old, plan.new, layouts, plan.kept_workers())
            stats["gather"] = gather_weights(worker.weights, gather, self._me)
        if txn.get("preload") is not None:
            stats["preload"] = txn.pop("preload").join()   # raises what the loading thread raised
        if txn["kept"]:
            return stats
        if new is not None:
            started = time.perf_counter()
            stats["weights_last"] = worker.weights.set_role(new[1], new[2], new[0], txn["new_layers"])
            stats["weights_last_seconds"] = time.perf_counter() - started
        self._check_fault("weights_last")
        stats["weights_bytes_after"] = worker.budget.used_bytes("weights")
        self._check_fault("prepared")
        return stats

    # ------------------------------------------------------------------ commit point and rollback
    def commit(self) -> dict:
        """The commit point: drop the old KV pool, grow the new one to its capacity, serve the new topology (or
        go to standby: no pool, no shard, the process and its groups stay for a fast wake-up). A deferred-KV plan
        (a parameter drop) keeps the old pool for the exchange instead, and the control plane grows the new pool
        as the budget allows (worker_exchange.py)."""
        worker = self.worker
        txn = self._require_txn()
        plan: ReshapePlan = txn["plan"]
        if not txn["kept"]:
            if worker.pool is not None and not plan.defer_kv:
                worker.pool.arena.close()
            elif worker.pool is not None:   # only the exchange reads it now: its free blocks go for good
                worker.pool.detach_blocks(txn["trimmed"])
            new_pool: KVPagePool | None = txn["new_pool"]
            worker.instance.set_pool(new_pool)
            new_role = plan.new.role(self._me)
            if new_role is None:
                worker.weights.release_all()
            elif plan.new_num_blocks[new_role[0]] > new_pool.num_blocks and not plan.defer_kv:
                new_pool.attach_blocks(plan.new_num_blocks[new_role[0]] - new_pool.num_blocks)
        worker.topology = plan.new
        worker.apply_stage()
        if plan.defer_kv and "exchange" in txn:
            worker.exchange.begin(plan.transfers, *txn["exchange"], chunks=txn.get("chunks"))
        self._txn = None
        self._check_fault("committed")
        return worker.memory_report()

    def abort(self) -> dict:
        """Roll back to the old topology: old weights shard (refilled from the host store), old KV pool."""
        worker = self.worker
        txn = self._txn
        if txn is None:
            return worker.memory_report()
        self._txn = None
        if txn.get("preload") is not None:
            txn.pop("preload").join(raise_error=False)   # let the loader finish before the pages are rolled back
        if txn["kept"]:  # moved KV landed in blocks that stay free in the old plan
            return worker.memory_report()
        # Order matters for the budget: every step moves toward the old state, which fitted.
        if txn["new_pool"] is not None:
            txn["new_pool"].arena.close()
        if txn["old"] is None:
            worker.weights.release_all()  # back to standby
        else:
            old_group, old_tp, old_rank = txn["old"]
            worker.weights.set_role(old_tp, old_rank, old_group, txn["old_layers"])
        pool = worker.pool
        if pool is not None:
            pool.recommit(txn["trimmed"])
        return worker.memory_report()


class _Preload:
    """A thread loading a role's missing weight chunks from the host store (ShardedWeights.preload)."""

    def __init__(self, weights, tp: int, rank: int, layers: tuple[int, int]):
        self.result: dict = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(weights, tp, rank, layers), daemon=True,
                                       name="elastic-hf-weight-preload")
        self.thread.start()

    def _run(self, weights, tp, rank, layers) -> None:
        started = time.perf_counter()
        try:
            self.result = {"bytes": weights.preload(tp, rank, layers)}
        except BaseException as exc:  # noqa: BLE001 - handed to the RPC thread at join
            self.error = exc
        self.result["seconds"] = time.perf_counter() - started

    def join(self, raise_error: bool = True) -> dict:
        self.thread.join()
        if self.error is not None and raise_error:
            raise self.error
        return self.result
