"""Executes the overload arbiter's decisions on a deployment (engine/overload.py decides): parameter drops
(KunServe §4.1-4.2) with their coordinated KV exchange, TP merges, restores, and which morph controllers may act.
Also the operator's surface: `drop` and `restore` (POST /admin/drop, /admin/restore; ElasticModel.drop/restore).

A drop is a reshape transaction into pipeline groups whose KV moves after the commit point
(`run_reshape(defer_kv=True)`): every member releases the layers it no longer owns before anything else (the pages
go back; ledger and RSS show it), the new pools take the freed bytes as KV blocks at once, the queued requests run
while the running ones wait for their KV (parallel/kv_exchange.py), and nothing is recomputed. The layer split of a
group comes from the fitted cost model when one is configured (`elastic-hf profile-cost`), else from the weight
bytes of a layer and of the LM head (decode reads every weight once per step, so bytes track time)."""
from __future__ import annotations

import logging
import time

from elastic_hf.engine.cost_fit import OnlineCostFit
from elastic_hf.engine.drop_plan import DropRefusal, plan_drop, stage_split
from elastic_hf.engine.overload import OverloadArbiter, OverloadDecision, OverloadSnapshot
from elastic_hf.parallel.kv_exchange import KVExchange
from elastic_hf.parallel.overload_metrics import OverloadMetrics
from elastic_hf.parallel.reshape import ReshapeAborted, ReshapeReport, run_reshape
from elastic_hf.parallel.restore_prewarm import RestorePrewarm
from elastic_hf.parallel.worker_pool import WorkerError
from elastic_hf.topology import InstanceShape, Topology
from elastic_hf.units import ceil_div

log = logging.getLogger(__name__)

SPLIT_PREFIX_TOKENS = 512   # context of the decode step the cost-model split is balanced for
# A drop's pipeline is split to hold this much more than the KV demand at the trigger (or the demand the arbiter
# projects, engine/overload.py, when that is more): a burst is still arriving then (the demand of the benchmark's
# bursts peaked at 1.3x the trigger's). stage_split takes the fastest split that holds it, else the one that holds
# the most.
SPLIT_DEMAND_MARGIN = 1.5


class OverloadControl:
    def __init__(self, deployment):
        self.dep = deployment
        config = deployment.config
        self.policy = config.overload
        has_morph = any(m.controller is not None for m in deployment.morph_managers.values())
        self.arbiter = OverloadArbiter(self.policy, has_morph, config.num_workers > 1)
        self.metrics = OverloadMetrics(deployment.metrics.registry, config.num_workers)
        self.base_topology: Topology = deployment.topology
        self.exchange: KVExchange | None = None
        self.prewarm: RestorePrewarm | None = None   # a restore whose layers load beside the steps
        # The fitted micro-batch cost model (layer splits of drops, lookahead micro-batches): the configured
        # profile, else the one shipped for the default model at this dtype, else none (bytes and token counts)
        from elastic_hf.engine.cost_model import CostModel, shipped_cost_model
        from elastic_hf.model.loader import parse_dtype

        dtype = None if config.dtype == "auto" else str(parse_dtype(config.dtype)).removeprefix("torch.")
        self.cost_model = (CostModel.load(config.cost_profile) if config.cost_profile is not None
                           else shipped_cost_model(deployment.model_id, dtype) if dtype else None)
        # none: fitted from the stage times of the first pipelines that serve (engine/cost_fit.py)
        self.cost_fit = OnlineCostFit(deployment.num_layers, f"{deployment.model_id}, fitted while serving") \
            if self.cost_model is None and self.policy.lookahead else None
        info = deployment.pool.call(0, "info")
        self.layer_bytes = info["weights_tp1_bytes"] - info["replicated_weights_bytes"]   # all decoder layers
        # What merging two whole-model instances into a pipeline frees: one copy of the decoder layers and the
        # vocabulary tables neither stage reads (parallel/stage_tables.py; the first stage's tied table).
        self.merge_freed_bytes = self.layer_bytes + 2 * info["replicated_weights_bytes"] \
            - info["first_stage_replicated_bytes"] - info["last_stage_replicated_bytes"]
        self.head_bytes = info["lm_head_bytes"]
        self.base_weights = [r["weights_bytes"] for r in deployment.memory_report()]
        self.history: list[dict] = []   # drops, merges and restores with their outcome (GET /admin/drop)
        self.apply_morph_gate()
        self.apply_lookahead()

    # ------------------------------------------------------------------ every step
    def on_step(self) -> None:
        """At a step boundary: how far an exchange in flight is (finished when done), then the arbiter's decision."""
        if self.exchange is not None:
            if self.exchange.poll(idle=not self.dep.has_runnable_work()):
                self.history.append({"event": "exchange_done", **_exchange_dict(self.exchange)})
                self.exchange = None
        if self.prewarm is not None and self.prewarm.poll(idle=not self.dep.has_runnable_work()):
            self._commit_restore()
        self.metrics.exchanging.set(sum(len(i.engine.scheduler.exchanging) for i in self.dep.instances))
        if self.cost_fit is not None:
            self._adopt_fitted_cost_model()
        errors = [i.runner.last_cost_error for i in self.dep.instances
                  if i.runner.lookahead is not None and i.runner.last_cost_error is not None]
        if errors:
            self.metrics.cost_model_error.set(max(errors))
        snap = self.snapshot()
        self.metrics.demand_ratio.set(snap.demand_ratio)
        decision = self.arbiter.decide(snap)
        if decision is not None:
            self.execute(decision, snap)
        self._pace_exchange()

    def _pace_exchange(self) -> None:
        """The exchange's CPU cap for the next steps of its instances: `exchange_cpu_share_queued` while requests
        queue for KV blocks (they are admitted when it ends, and the parked ones resume then), if set; the policy's
        cap otherwise."""
        exchange, policy = self.exchange, self.policy
        share = None
        if exchange is not None:
            queued = any(i.engine.scheduler.waiting for i in exchange.instances)
            share = policy.exchange_cpu_share_queued if queued and policy.exchange_cpu_share_queued is not None \
                else policy.exchange_cpu_share
            exchange.stats.queued_boundaries += queued
        for inst in self.dep.instances:
            inst.runner.exchange_cpu_share = share if exchange is not None and inst in exchange.instances else None

    def apply_lookahead(self) -> None:
        """Every pipelined instance cuts its steps by the cost model (KunServe §4.3), a static pipeline as well as a
        drop group; without a cost model (or with the `lookahead` ablation off) by token counts. Their stage stats
        come back to on_stage_reports."""
        model = self.cost_model if self.policy.lookahead else None
        for inst in self.dep.instances:
            inst.runner.lookahead = model if inst.shape.pp > 1 else None
            inst.runner.cost_fit = self.cost_fit if inst.shape.pp > 1 and model is None else None
            inst.runner.on_stage_reports = self.on_stage_reports

    def on_stage_reports(self, stage_stats: list[dict]) -> None:
        """A pipelined step's stage stats: the KV exchange's and a restore prewarm's progress ride on them."""
        exchange, prewarm = self.exchange, self.prewarm
        for stats in stage_stats:
            if exchange is not None and stats.get("exchange") is not None:
                exchange.note(stats["worker"], stats["exchange"])
            if prewarm is not None and "prewarm" in stats:
                prewarm.note(stats["worker"], stats["prewarm"])

    def _adopt_fitted_cost_model(self) -> None:
        """Once the stage times determine a cost model, the pipelines cut their steps by it from now on."""
        model = self.cost_fit.model()
        if model is None:
            return
        log.info("cost model fitted from %d pipeline stage reports: %s", self.cost_fit.num_samples, model)
        self.cost_model, self.cost_fit = model, None
        self.apply_lookahead()

    def wants_steps(self) -> bool:
        """Keep an idle driver stepping while an exchange is in flight or a drop / merge waits for its restore
        window (the low load must be observed at step boundaries)."""
        return self.exchange is not None or self.prewarm is not None or self.arbiter.active in ("drop", "tp-merge")

    def snapshot(self) -> OverloadSnapshot:
        dep = self.dep
        bs = dep.config.block_size
        demand = capacity = 0
        for inst in dep.instances:
            scheduler = inst.engine.scheduler
            queued = sum(ceil_div(len(s.token_ids) + 1, bs) for s in scheduler.waiting)
            demand += (scheduler.kv.num_used + queued) * bs
            capacity += scheduler.kv.num_total * bs
        base = sum(dep.capacity(key) for key in self.base_topology.instance_keys()) * bs
        gain = sum(m.gain_left_blocks() for m in dep.morph_managers.values()) * bs
        morphed = any(not m.is_full_precision() for m in dep.morph_managers.values())
        return OverloadSnapshot(demand, capacity, base, gain, morphed)

    def execute(self, decision: OverloadDecision, snap: OverloadSnapshot) -> bool:
        log.info("overload: %s (%s)", decision.action, decision.reason)
        action = decision.action
        ok = True
        if action == "drop":
            ok = self.drop(decision.need_tokens) is not None
            if not ok and self.policy.mode == "auto":
                action, ok = "tp-merge", self.tp_merge() is not None   # the fallback when no drop plan exists
        elif action == "tp-merge":
            ok = self.tp_merge() is not None
        elif action == "restore":
            ok = self.begin_restore()
        self.metrics.decisions.labels(action=action, outcome="done" if ok else "refused").inc()
        self.arbiter.done(action, ok)
        self.metrics.set_active(self.arbiter.active)
        self.apply_morph_gate()
        return ok

    def apply_morph_gate(self) -> None:
        """Morph controllers act only when the arbiter lets them (overload off: as configured by the morph mode)."""
        if self.policy.mode == "off":
            return
        for manager in self.dep.morph_managers.values():
            if manager.controller is not None and manager.controller.enabled != self.arbiter.morph_controllers_on:
                manager.set_controller(self.arbiter.morph_controllers_on)

    # ------------------------------------------------------------------ the responses
    def drop(self, demand_tokens: int = 1) -> ReshapeReport | None:
        """Drop replicated layers to free at least `demand_tokens` of KV (1: the smallest drop, merging the two
        smallest neighbouring groups). Returns the committed reshape, or None when there is no plan or the
        transaction rolled back (the layout serves on as before; the reason is logged and counted)."""
        dep = self.dep
        if any(inst.shape.tp != 1 for inst in dep.instances):
            return self._refused("drop", f"drop groups data-parallel TP1 instances; topology is {dep.topology}")
        token_bytes = self.layer_bytes_per_token()
        plan = plan_drop([inst.shape.pp for inst in dep.instances], self.merge_freed_bytes,
                         max(demand_tokens, 1) * token_bytes)
        if isinstance(plan, DropRefusal):
            return self._refused("drop", plan.reason)
        demand = max(self.snapshot().demand_tokens, self.arbiter.projected_tokens)
        num_workers = sum(plan.new_sizes)
        target = [self.group_shape(n, int(demand * SPLIT_DEMAND_MARGIN * n / num_workers)) for n in plan.new_sizes]
        # A plan that does not cover the demand merges every group (Fig. 6 runs out of pairs): the rest queues.
        # allow_preemption: where the new layout cannot hold every running request's KV (a stage with more layers
        # than half, or an exchange whose chunked peak, kv/exchange_schedule.py, exceeds a member's budget) the
        # youngest running requests go over without their KV (recomputed, counted in the history) rather than the
        # whole drop being refused while every queued request waits.
        return self._reshape("drop", target, defer_kv=self.policy.exchange == "coordinated",
                             extra={"demand_bytes": plan.demand_bytes, "planned_free_bytes": plan.freed_bytes},
                             allow_preemption=True)

    def tp_merge(self) -> ReshapeReport | None:
        """Merge neighbouring TP1 instances in pairs into TP2 ones (each worker then holds half of the weights)."""
        dep = self.dep
        sizes = dep.topology.sizes
        if 2 not in dep.degrees or any(s != 1 for s in sizes) or len(sizes) < 2:
            return self._refused("tp-merge", f"a TP merge needs TP1 instances and TP2 allowed; topology "
                                             f"{dep.topology}, degrees {list(dep.degrees)}")
        target = [2] * (len(sizes) // 2) + [1] * (len(sizes) % 2)
        return self._reshape("tp-merge", target)

    def restore(self) -> ReshapeReport | None:
        """Back to the configured layout now: the dropped layers (or full shards) come back from the shared host
        store while the KV is redistributed (KunServe §4.4); layers a prewarm loaded already are used as they are."""
        if self.dep.topology == self.base_topology:
            return None
        prewarm, self.prewarm = self.prewarm, None
        extra = prewarm.summary() if prewarm is not None else {}
        report = self._reshape("restore", self.base_topology, extra=extra,
                               precopy=prewarm.precopy if prewarm is not None else None)
        if report is None and prewarm is not None and self.dep.topology != self.base_topology:
            # Refused or rolled back: the dropped layout serves on, the loaded layers and the KV copy go back (a
            # rollback's workers released them already) and the KV managers grow by the blocks they gave.
            prewarm.cancel()
        return report

    def begin_restore(self) -> bool:
        """The arbiter's restore. After a drop the layers first load beside the steps (restore_prewarm.py) and the
        reshape commits at a later step boundary; after a TP merge, or without enough free KV blocks for the
        layers, it runs now. An operator may have restored already: that counts."""
        if self.dep.topology == self.base_topology:
            return True
        dropped = all(i.shape.tp == 1 for i in self.dep.instances) and any(i.shape.pp > 1 for i in self.dep.instances)
        if self.prewarm is None and self.exchange is None and dropped:
            self.prewarm = RestorePrewarm.start(self.dep, self.base_topology, self.policy.exchange_cpu_share)
            if self.prewarm is not None:
                return True
        return self.restore() is not None

    def _commit_restore(self) -> None:
        if self.restore() is None and self.dep.topology != self.base_topology:
            self.arbiter.active = "drop"   # refused or rolled back (restore() gave the prewarm back): still dropped
            self.metrics.set_active(self.arbiter.active)

    def settle_exchange(self) -> None:
        if self.exchange is not None:
            self.exchange.run_to_end()
            self.history.append({"event": "exchange_done", **_exchange_dict(self.exchange)})
            self.exchange = None

    def start_exchange(self, plan) -> None:
        """Called by the deployment right after a deferred-KV plan's commit (resume)."""
        dep = self.dep
        workers = sorted({w for t in plan.transfers for w in (t.src_worker, t.dst_worker)}
                         | {w for idx, ws in enumerate(plan.new.instances()) if idx not in plan.kept for w in ws})
        touched = [inst for idx, inst in enumerate(dep.instances)
                   if idx not in plan.kept or inst.engine.scheduler.exchanging]
        self.exchange = KVExchange(dep.pool, workers, touched, self.policy.exchange_cpu_share, self.metrics)
        if not plan.transfers:   # no running request moved: only the old pools to close
            self.settle_exchange()

    def on_workers_lost(self, dead: list[int]) -> None:
        """A group member died: an exchange in flight is abandoned (the survivors drop the KV in transit; the
        deployment recomputes its requests)."""
        if self.exchange is not None:
            self.exchange.abandon([w for w in self.exchange.workers if w not in dead])
            self.exchange = None
        if self.prewarm is not None:
            self.prewarm.abandon_copy([w for w in self.prewarm.workers if w not in dead])

    # ------------------------------------------------------------------ helpers
    def layer_bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers on a TP1 worker (what a freed weight byte buys)."""
        info = self.dep.pool.call(0, "info")
        return max(1, info["kv_block_bytes_tp1"] // self.dep.config.block_size)

    def group_shape(self, n: int, need_tokens: int = 0) -> InstanceShape | int:
        """The shape of a merged group of n workers: the fastest layer split whose KV holds need_tokens, else the
        one that holds the most (stage_split)."""
        if n == 1:
            return 1
        dep = self.dep
        num_layers = dep.num_layers
        if self.cost_model is not None:
            from elastic_hf.engine.cost_model import Chunk

            # A representative overloaded decode step: the split balances what a stage spends per step.
            step = [Chunk(prefix=SPLIT_PREFIX_TOKENS, tokens=1, sampled=True)] * self.dep.config.max_num_seqs
            layer_cost = self.cost_model.decoder_cost(step) / self.cost_model.num_layers
            head_cost = self.cost_model.head_cost(step)
        else:
            layer_cost, head_cost = self.layer_bytes / num_layers, self.head_bytes

        def held(split: tuple[int, ...]) -> int:   # any n workers hold what these do: they have the same budget
            return dep.capacity((tuple(range(n)), InstanceShape(1, n, split))) * dep.config.block_size

        return InstanceShape(1, n, stage_split(num_layers, n, layer_cost, head_cost, held, need_tokens))

    def _reshape(self, kind: str, target, defer_kv: bool = False, extra: dict | None = None,
                 precopy=None, allow_preemption: bool = False) -> ReshapeReport | None:
        if self.prewarm is not None:   # a restore's layers were loading: another reshape comes first
            self.prewarm.cancel()
            self.prewarm = None
        started = time.perf_counter()
        # The commit starts the KV exchange from inside run_reshape, and one with nothing to move settles at once:
        # the reshape's own entry goes before whatever the exchange logged meanwhile, in commit order.
        position = len(self.history)
        try:
            report = run_reshape(self.dep, target, defer_kv=defer_kv, precopy=precopy,
                                 allow_preemption=allow_preemption)
        except (ValueError, ReshapeAborted) as exc:
            outcome = "rolled_back" if isinstance(exc, ReshapeAborted) else "refused"
            if kind == "drop":
                self.metrics.drops.labels(outcome=outcome).inc()
            self.history.append({"event": kind, "outcome": outcome, "reason": str(exc)})
            log.warning("%s to %s %s: %s", kind, target, outcome.replace("_", " "), exc)
            return None
        if kind == "drop":
            self.metrics.drops.labels(outcome="committed").inc()
        elif kind == "restore" and report.old.startswith("[1x"):
            self.metrics.drops.labels(outcome="restored").inc()
        try:
            weights = [r["weights_bytes"] for r in self.dep.memory_report()]
        except WorkerError:   # a member died past the commit point (mid-exchange): replaced, its requests recomputed
            if not self.dep.pool.check_health():
                raise
            self.dep.recover()
            weights = [r["weights_bytes"] for r in self.dep.memory_report()]
        for w, (before, now) in enumerate(zip(self.base_weights, weights)):
            self.metrics.dropped_bytes.labels(worker=str(w)).set(max(0, before - now))
        self.history.insert(position, {"event": kind, "outcome": "committed", "old": report.old, "new": report.new,
                                       "seconds": round(time.perf_counter() - started, 4),
                                       "dropped_weight_bytes": [max(0, b - n)
                                                                for b, n in zip(self.base_weights, weights)],
                                       "preempted": len(report.preempted),
                                       **(extra or {})})
        return report

    def _refused(self, kind: str, reason: str) -> None:
        log.info("%s refused, the deployment serves on as before: %s", kind, reason)
        if kind == "drop":
            self.metrics.drops.labels(outcome="refused").inc()
        self.history.append({"event": kind, "outcome": "refused", "reason": reason})
        return None

    def state(self) -> dict:
        snap = self.snapshot()
        return {"mode": self.policy.mode, "active": self.arbiter.active, "topology": str(self.dep.topology),
                "base_topology": str(self.base_topology), "demand_tokens": snap.demand_tokens,
                "capacity_tokens": snap.capacity_tokens, "base_capacity_tokens": snap.base_capacity_tokens,
                "demand_ratio": round(snap.demand_ratio, 4), "projected_demand_tokens": self.arbiter.projected_tokens,
                "exchange": None if self.exchange is None else _exchange_dict(self.exchange),
                "restore_prewarm": None if self.prewarm is None else self.prewarm.summary(),
                "history": list(self.history)}


def _exchange_dict(exchange: KVExchange) -> dict:
    s = exchange.stats
    return {"done": exchange.done, "layers_moved": s.layers, "step_boundaries": s.polls, "sent_bytes": s.sent_bytes,
            "seconds": round(s.seconds, 4), "paced_seconds": round(s.paced_seconds, 4),
            "wall_seconds": round(s.wall_seconds, 4), "parked_seqs": s.num_parked_seqs,
            "queued_boundaries": s.queued_boundaries, "max_cpu_share": s.max_cpu_share,
            "stalled_now": exchange.num_parked}
