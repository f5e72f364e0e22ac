"""The reshape transaction of a deployment (ReMP §3.9, Gyges §4): change the TP x PP layout of running instances
in place. `plan_reshape` and `resume_instances` are functions over data (schedulers, KV managers, requests);
`run_reshape` executes the phases on the workers: quiesce (the caller is between steps) -> plan -> every worker
prepares, migrates KV, switches weights -> commit point -> resume with merged or split schedulers. A failure before
the commit point rolls every worker back and the old instances keep serving their requests untouched; a worker lost
after it is replaced under the new topology."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elastic_hf.engine.sequence import Request
from elastic_hf.kv.exchange_schedule import EXCHANGE_CHUNKS
from elastic_hf.kv.kv_manager import KVManager
from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan, check_plan, plan_payload_bytes
from elastic_hf.model.loader import parse_dtype
from elastic_hf.parallel.reshape_plan import ReshapePlan, transition_overflow
from elastic_hf.parallel.worker_pool import WorkerError
from elastic_hf.parallel.worker_reshape import RESHAPE_PHASES
from elastic_hf.topology import Topology
from elastic_hf.units import format_bytes

log = logging.getLogger(__name__)


class ReshapeAborted(RuntimeError):
    """The reshape failed before its commit point; the deployment still serves the old topology."""


@dataclass(slots=True)
class ReshapeReport:
    old: str
    new: str
    seconds: float
    committed: bool
    worker_stats: list[dict] = field(default_factory=list)
    num_moved_seqs: int = 0
    kv_plan_bytes: dict = field(default_factory=dict)   # what the plan moves: {"sent": ..., "local": ...}
    preempted: list[str] = field(default_factory=list)  # requests recomputed: the new layout held too little KV
    # Every worker's memory report at its commit point, before anything runs on the new layout (a drop's KV
    # exchange starts right after it and writes into the new pools)
    committed_memory: list[dict] = field(default_factory=list)

    def summary(self) -> dict:
        """What the admin API returns: everything but the per-worker reports."""
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("worker_stats", "committed_memory")}


@dataclass(slots=True)
class RequestPlacement:
    """Where every request of a changing instance goes, with the KV managers of the new instances (a kept
    instance's own manager, with the blocks taken on it listed for rollback)."""
    requests: dict[int, list[Request]]
    kv_managers: dict[int, KVManager]
    taken_on_kept: list[tuple[KVManager, list[int]]]
    preempted: list[str] = field(default_factory=list)   # request ids that go over without their KV (recompute)
    # seq_id -> its block ids on its new instance (a sequence sharing cached prefix blocks gets its own copies)
    new_blocks: dict[int, list[int]] = field(default_factory=dict)

    def release_taken(self) -> None:
        for kv, block_ids in self.taken_on_kept:
            kv.free(block_ids)


@dataclass(frozen=True, slots=True)
class PinnedSeq:
    """A running sequence whose first blocks a restore copied ahead of its commit (restore_precopy.py)."""
    dst: int                      # new instance
    copied: tuple[int, ...]       # its old block ids whose KV was copied (full blocks: never written again)
    new_ids: tuple[int, ...]      # its blocks on the new instance's KV manager (the copied ones first)
    num_preemptions: int          # a preemption since invalidates the copy


@dataclass(slots=True)
class PreCopy:
    """The new instances' KV managers of a restore planned ahead, with the sequences pinned to them."""
    kv_managers: dict[int, KVManager]
    pinned: dict[int, PinnedSeq]

    def discard(self, seq_id: int) -> None:
        pin = self.pinned.pop(seq_id, None)
        if pin is not None:
            kv = self.kv_managers[pin.dst]
            kv.free(list(pin.new_ids))

    def pins_of(self, request: Request) -> dict[int, PinnedSeq] | None:
        """The pins of a request whose every sequence kept the blocks copied for it (else they are dropped and it
        is placed like any other)."""
        for s in request.seqs:   # ended (a finished sibling) or preempted and waiting: nothing of it moves
            if not s.block_ids:
                self.discard(s.seq_id)
        pins = {s.seq_id: self.pinned[s.seq_id] for s in request.seqs if s.seq_id in self.pinned}
        valid = pins and len({p.dst for p in pins.values()}) == 1 and all(
            s.seq_id in pins and s.num_preemptions == pins[s.seq_id].num_preemptions
            and len(s.block_ids) >= len(pins[s.seq_id].new_ids)
            and tuple(s.block_ids[:len(pins[s.seq_id].copied)]) == pins[s.seq_id].copied
            for s in request.seqs if s.block_ids)
        if not valid:
            for seq_id in pins:
                self.discard(seq_id)
            return None
        return pins


def plan_reshape(instances, old: Topology, new: Topology, capacity: Callable[[tuple], int],
                 num_kv_heads: int, num_layers: int, weights_source: str, allow_preemption: bool = False,
                 footprints: list[dict] | None = None, precopy: PreCopy | None = None,
                 defer_kv: bool = False) -> tuple[ReshapePlan, RequestPlacement]:
    """Instances whose workers and layout (TP x PP, layer split) do not change keep their engine, pool and block
    ids (and may receive requests, e.g. from a worker going to standby). Every request of a changing instance goes
    to a new instance that shares a worker with it (local heads stay local) or, failing that, to any;
    least-loaded first, with fresh block ids there; oldest requests first.

    Two limits, the new instances' KV capacity and every worker's budget during the transaction (`footprints`,
    Worker.reshape_footprint: until the commit point a worker holds its old live KV, the new KV and the new
    weights at once). A request that breaks either is preempted by recompute when allow_preemption (ReMP §3.5.5:
    it goes over without its KV and is prefilled again; youngest first; reported in placement.preempted), else
    ValueError (nothing has changed then). A request no new instance could ever hold is always a ValueError.

    precopy: a restore whose full blocks were copied beside the steps: its KV managers are the new instances',
    its still valid sequences go where they were copied to, and the plan's transfers move only the rest.
    defer_kv: a parameter drop's plan, whose KV moves after the commit point (parallel/kv_exchange.py)."""
    forced: set[str] = set()
    while True:
        plan, placement = _place(instances, old, new, capacity, num_kv_heads, num_layers, weights_source,
                                 allow_preemption, forced, precopy, defer_kv)
        over = transition_overflow(plan, footprints) if footprints is not None else []
        if defer_kv and over:   # both pools whole do not fit: the exchange gives the old pages back chunk by chunk
            plan.exchange_chunks = EXCHANGE_CHUNKS
            over = transition_overflow(plan, footprints)
        if not over:
            return plan, placement
        placement.release_taken()
        movable = [r for _, r in _changing_requests(instances, plan.kept) if r.request_id not in placement.preempted]
        if not allow_preemption or not movable:
            worker, need, budget = over[0]
            when = "during its KV exchange" if defer_kv else "before the commit point"
            raise ValueError(f"reshape {old} -> {new}: worker {worker} would need {format_bytes(need)} {when} (old "
                             f"live KV, migrated KV and new weights) with a budget of {format_bytes(budget)}")
        forced.add(movable[-1].request_id)   # the youngest goes over without its KV


def _changing_requests(instances, kept: dict[int, int]) -> list[tuple[int, Request]]:
    """(old instance, request) of every instance that does not stay as it is, oldest request first."""
    requests = [(idx, r) for idx, inst in enumerate(instances) if idx not in kept.values()
                for r in inst.engine.requests.values()]
    return sorted(requests, key=lambda item: item[1].arrival_time)


def _place(instances, old: Topology, new: Topology, capacity, num_kv_heads: int, num_layers: int,
           weights_source: str, allow_preemption: bool, forced: set[str],
           precopy: PreCopy | None = None, defer_kv: bool = False) -> tuple[ReshapePlan, RequestPlacement]:
    new_instances = new.instances()
    new_keys, old_keys = new.instance_keys(), old.instance_keys()
    kept = {new_idx: old_keys.index(key) for new_idx, key in enumerate(new_keys) if key in old_keys}
    changing = [idx for idx in range(len(new_instances)) if idx not in kept]
    block_size = instances[0].engine.scheduler.block_size
    made = precopy.kv_managers if precopy is not None else {}
    kv_managers = {idx: (instances[kept[idx]].engine.scheduler.kv if idx in kept
                         else made[idx] if idx in made else KVManager(capacity(new_keys[idx]), block_size))
                   for idx in range(len(new_instances))}
    num_total = {idx: kv_managers[idx].num_total for idx in kv_managers}
    placement = RequestPlacement({idx: [] for idx in range(len(new_instances))}, kv_managers, [])
    moves: list[BlockMove] = []
    to_move: list[BlockMove] = []   # what the transfers carry: moves less the blocks a pre-copy moved already
    seq_moves: dict[int, tuple[int, int]] = {}
    changing_requests = _changing_requests(instances, kept)
    if precopy is not None:   # sequences that ended since the copy give their new blocks back
        alive = {s.seq_id for _, r in changing_requests for s in r.seqs}
        for seq_id in [i for i in precopy.pinned if i not in alive]:
            precopy.discard(seq_id)
    try:
        for old_idx, request in changing_requests:
            old_workers = set(instances[old_idx].workers)
            pins = precopy.pins_of(request) if precopy is not None else None
            need = sum(len(s.block_ids) - (len(pins[s.seq_id].new_ids) if s.seq_id in (pins or {}) else 0)
                       for s in request.seqs)
            free = [idx for idx in kv_managers if kv_managers[idx].num_free >= need]
            local = [idx for idx in free if old_workers & set(new_instances[idx])]
            if pins is not None:
                pinned_to = next(iter(pins.values())).dst
                local = free = [pinned_to] if pinned_to in free else []
            candidates = [] if request.request_id in forced else (local or free)
            preempt = not candidates and allow_preemption
            if preempt:
                candidates = [idx for idx in kv_managers if num_total[idx] >= need]
            if not candidates:
                raise ValueError(f"reshape {old} -> {new}: request {request.request_id!r} holds {need} KV blocks and "
                                 f"no new instance has that many free "
                                 f"({ {i: m.num_free for i, m in kv_managers.items()} } free of {num_total})")
            dst = min(candidates, key=lambda idx: (kv_managers[idx].num_used / max(num_total[idx], 1), idx))
            placement.requests[dst].append(request)
            if preempt:
                placement.preempted.append(request.request_id)
            if preempt and pins is not None:
                for seq_id in pins:
                    precopy.discard(seq_id)
                pins = None
            for seq in request.seqs:
                seq_moves[seq.seq_id] = (old_idx, dst)
                if seq.block_ids and not preempt:
                    pin = (pins or {}).get(seq.seq_id)
                    reused = list(pin.new_ids) if pin is not None else []
                    taken = kv_managers[dst].allocate(len(seq.block_ids) - len(reused))
                    if dst in kept or dst in made:   # a failed attempt gives them back (a pin's stay pinned)
                        placement.taken_on_kept.append((kv_managers[dst], taken))
                    new_blocks = reused + taken
                    placement.new_blocks[seq.seq_id] = new_blocks
                    moves.append(BlockMove(old_idx, dst, tuple(seq.block_ids), tuple(new_blocks)))
                    done = len(pin.copied) if pin is not None else 0
                    if done < len(new_blocks):
                        to_move.append(BlockMove(old_idx, dst, tuple(seq.block_ids[done:]), tuple(new_blocks[done:])))
        # The old pools keep the live blocks of the requests that move until the commit point (rollback needs
        # them); a preempted request's blocks are given back at once.
        live_old = {old_idx: [b for s in inst.engine.scheduler.running if s.request_id not in placement.preempted
                              for b in s.block_ids] for old_idx, inst in enumerate(instances)}
        transfers = build_migration_plan(to_move, old, new, num_kv_heads, num_layers)
        check_plan(to_move, transfers, old, new, num_kv_heads, num_layers)   # ReMP §3.5.5, before anything moves
        # A new pool attaches blocks 0 .. n-1: n covers the highest block id a move uses (a pre-copy's managers may
        # have given some back in between; a fresh manager's ids are 0 .. used-1).
        live_new = {idx: 1 + max((b for m in moves if m.dst_instance == idx for b in m.dst_blocks), default=-1)
                    for idx in changing}
        plan = ReshapePlan(old, new, moves, transfers, live_old, live_new, num_total, seq_moves, kept,
                           weights_source, defer_kv=defer_kv, precopied=precopy is not None)
    except BaseException:
        placement.release_taken()
        raise
    return plan, placement


# Counters of the engines a reshape retires, kept by the deployment; the last: prefix-cache blocks they named,
# which go with them (a new instance starts with an empty cache; a kept one keeps its own).
RETIRED_COUNTERS = ("num_computed_prompt_tokens", "num_steps", "num_preemptions", "prefix_cache_queried_tokens",
                    "prefix_cache_hit_tokens", "prefix_cache_dropped_blocks")


def resume_instances(instances, new: Topology, plan: ReshapePlan, placement: RequestPlacement, make_instance):
    """The instances after the commit point: kept ones keep their engine and adopt the requests moved to them; the
    others get a new engine over their new KV manager. make_instance((workers, shape), kv_manager) builds one. With a
    deferred-KV plan the moved requests wait in the exchanging state until their KV has arrived.
    Returns (new instances, the cumulative counters of the retired engines, RETIRED_COUNTERS: a deployment's totals
    must not fall back when an engine is replaced)."""
    retired_engines = [inst.engine for idx, inst in enumerate(instances) if idx not in plan.kept.values()]
    retired_stats = [e.stats() for e in retired_engines]
    for stats in retired_stats:
        stats["prefix_cache_dropped_blocks"] = stats["prefix_cache_blocks"]
    retired = {key: sum(s[key] for s in retired_stats) for key in RETIRED_COUNTERS}
    out = []
    for idx, key in enumerate(new.instance_keys()):
        if idx in plan.kept:
            instance = instances[plan.kept[idx]]
        else:
            kv = placement.kv_managers[idx]
            if plan.defer_kv:   # the new pools hold only the moved KV's blocks until the exchange frees the old ones
                kv.limit_to_pools(plan.num_live_new_blocks.get(idx, 0))
            instance = make_instance(key, kv)
        for request in placement.requests[idx]:
            if request.request_id in placement.preempted:
                instance.engine.adopt(request, {}, recompute=True)
                continue
            blocks = {seq.seq_id: placement.new_blocks[seq.seq_id] for seq in request.seqs if seq.block_ids}
            instance.engine.adopt(request, blocks, exchanging=plan.defer_kv)
        out.append(instance)
    return out, retired


def restore_full_precision(morph_managers: dict, workers: list[int]) -> None:
    """Before a reshape moves these workers: their layers go back to fp (a TP shard is full precision). Raises
    ReshapeAborted when a restore waits for KV blocks still in use (nothing has changed then)."""
    for w in workers:
        manager = morph_managers.get(w)
        if manager is None or manager.is_full_precision():
            continue
        state = manager.restore_now()
        if not manager.is_full_precision():
            raise ReshapeAborted(f"worker {w} still runs layers {state['pending']} below full precision: "
                                 f"restoring them needs KV blocks that are in use ({state['kv_blocks_used']} "
                                 f"of {state['kv_blocks_total']} used); retry when load is lower")


def run_reshape(deployment, target, weights_source: str | None = None, allow_preemption: bool = False,
                overlap_weights: bool = True, defer_kv: bool = False, precopy: PreCopy | None = None) -> ReshapeReport:
    """Change the deployment's topology in place, e.g. [1, 1] -> [2] -> [1, 1]. Call between steps (the
    deployment's driver thread), which is the quiesce point. Raises ValueError for a topology that is not a
    candidate or a plan that does not fit, ReshapeAborted when a worker fails before the commit point; the old
    topology is then still serving. defer_kv: move the KV after the commit point, beside the steps (a parameter
    drop, parallel/kv_exchange.py); the deployment starts the exchange in `resume`. precopy: a restore whose full KV
    blocks the workers copied beside the steps (restore_precopy.py)."""
    new = deployment.check_topology(target)
    deployment.drain_batches()     # no step in flight: the plan reads every sequence's computed tokens and blocks
    deployment.settle_exchange()   # a previous drop's exchange finishes before anything else moves
    old = deployment.topology
    start = time.perf_counter()
    if new == old:
        return ReshapeReport(str(old), str(new), 0.0, True)
    # Scale-down refills shard chunks: over the GPU interconnect from peers is faster than host-to-device copies;
    # on CPU the shared host store is a plain memcpy and beats a loopback transfer.
    weights_source = weights_source or ("peers" if deployment.config.device.startswith("cuda") else "host")
    restore_full_precision(deployment.morph_managers, changing_workers(old, new))
    if not (old.is_tensor_only and new.is_tensor_only):
        weights_source = "host"   # the peer gather plan covers TP layouts; layer ranges come from the host store
    pool = deployment.pool
    workers = list(range(deployment.config.num_workers))
    footprints = pool.call_many(workers, "reshape_footprint", old, new)
    plan, placement = plan_reshape(deployment.instances, old, new, deployment.capacity, deployment.num_kv_heads,
                                   deployment.num_layers, weights_source, allow_preemption, footprints, precopy,
                                   defer_kv)
    plan.overlap_weights = overlap_weights
    try:
        stats = pool.call_many(workers, RESHAPE_PHASES[0], plan)
        for phase in RESHAPE_PHASES[1:]:
            stats = pool.call_many(workers, phase)
    except WorkerError as exc:
        placement.release_taken()
        for w in workers:
            if w in pool.check_health():
                continue  # a dead worker has nothing to roll back; it is replaced below
            try:
                pool.call(w, "reshape.abort")
            except WorkerError as rollback_error:
                log.error("rollback on worker %d failed: %s", w, rollback_error)
        # Requests preempted by the plan gave their old blocks back at prepare: they are recomputed here too.
        for inst in deployment.instances:
            for request_id in placement.preempted:
                if request_id in inst.engine.requests:
                    inst.engine.preempt_request(request_id)
        report = ReshapeReport(str(old), str(new), time.perf_counter() - start, False)
        deployment.on_reshape(report)
        deployment.recover()  # a worker that died before the commit point is replaced under the old topology
        raise ReshapeAborted(f"reshape {old} -> {new} rolled back: {exc}") from exc
    # ---- commit point: every worker holds the new shard, the migrated KV and the new groups ----
    lost = False
    committed_memory: list[dict] = []
    try:
        committed_memory = pool.call_many(workers, "reshape.commit")
    except WorkerError as exc:
        # Past the commit point there is no way back: a worker whose commit failed, dead or alive, cannot be trusted
        # to hold either layout. Those still alive are ended, and every one of them is replaced under the new
        # topology (its instance's requests recomputed), so all workers agree on one layout.
        for w in exc.failed_workers:
            if w not in pool.check_health():
                log.error("worker %d failed after the commit point (%s): replacing it", w, exc)
                pool.kill(w)
        lost = True
    deployment.resume(new, plan, placement)
    if lost:
        deployment.recover()  # after the commit point: replace the dead worker under the new topology
    itemsize = torch.empty((), dtype=parse_dtype(deployment.config.dtype)).element_size()
    report = ReshapeReport(str(old), str(new), time.perf_counter() - start, True, stats, len(plan.seq_moves),
                           plan_payload_bytes(plan.transfers, deployment.config.block_size, deployment.head_dim,
                                              itemsize), list(placement.preempted), committed_memory)
    if placement.preempted:
        log.warning("reshape %s -> %s preempted %d request(s) by recompute (the new layout holds less KV): %s", old,
                    new, len(placement.preempted), placement.preempted)
    deployment.on_reshape(report)
    return report


def changing_workers(old: Topology, new: Topology) -> list[int]:
    """Workers whose instance (workers and layout) is not the same before and after."""
    same = set(old.instance_keys()) & set(new.instance_keys())
    return sorted({w for key in old.instance_keys() + new.instance_keys() if key not in same for w in key[0]})
