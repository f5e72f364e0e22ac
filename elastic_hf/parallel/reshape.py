"""The reshape transaction of a deployment (ReMP §3.9, Gyges §4): change the TP layout of running instances in
place. `plan_reshape` and `resume_instances` are functions over data (schedulers, allocators, requests);
`run_reshape` executes the phases on the workers: quiesce (the caller is between steps) -> plan -> every worker
prepares, migrates KV, switches weights -> commit point -> resume with merged or split schedulers. A failure before
the commit point rolls every worker back and the old instances keep serving their requests untouched; a worker lost
after it is replaced under the new topology."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from elastic_hf.engine.sequence import Request
from elastic_hf.kv.block_allocator import BlockAllocator
from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan
from elastic_hf.parallel.reshape_plan import ReshapePlan
from elastic_hf.parallel.worker_pool import WorkerError
from elastic_hf.parallel.worker_reshape import RESHAPE_PHASES
from elastic_hf.topology import Topology, parse_topology

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


@dataclass(slots=True)
class RequestPlacement:
    """Where every request of a changing instance goes, with the allocators of the new instances (a kept
    instance's own allocator, with the blocks taken on it listed for rollback)."""
    requests: dict[int, list[Request]]
    allocators: dict[int, BlockAllocator]
    taken_on_kept: list[tuple[BlockAllocator, list[int]]]

    def release_taken(self) -> None:
        for allocator, block_ids in self.taken_on_kept:
            allocator.free(block_ids)


def plan_reshape(instances, old: Topology, new: Topology, capacity: Callable[[tuple[int, ...]], int],
                 num_kv_heads: int, weights_source: str) -> tuple[ReshapePlan, RequestPlacement]:
    """Instances whose worker set does not change keep their engine, pool and block ids (and may receive requests,
    e.g. from a worker going to standby). Every request of a changing instance goes to a new instance that shares a
    worker with it (local heads stay local) or, failing that, to any; least-loaded first, with fresh block ids
    there. Raises ValueError when a request fits nowhere (nothing has changed then)."""
    new_instances, old_instances = new.instances(), old.instances()
    kept = {new_idx: old_instances.index(ws) for new_idx, ws in enumerate(new_instances) if ws in old_instances}
    changing = [idx for idx in range(len(new_instances)) if idx not in kept]
    allocators = {idx: (instances[kept[idx]].engine.scheduler.allocator if idx in kept
                        else BlockAllocator(range(capacity(new_instances[idx])))) for idx in range(len(new_instances))}
    num_total = {idx: allocators[idx].num_total for idx in allocators}
    placement = RequestPlacement({idx: [] for idx in range(len(new_instances))}, allocators, [])
    moves: list[BlockMove] = []
    seq_moves: dict[int, tuple[int, int]] = {}
    live_old: dict[int, list[int]] = {}
    requests = []
    for old_idx, inst in enumerate(instances):
        live_old[old_idx] = [b for s in inst.engine.scheduler.running for b in s.block_ids]
        if old_idx not in kept.values():
            requests.extend((old_idx, r) for r in inst.engine.requests.values())
    requests.sort(key=lambda item: item[1].arrival_time)
    try:
        for old_idx, request in requests:
            old_workers = set(instances[old_idx].workers)
            need = sum(len(s.block_ids) for s in request.seqs)
            free = [idx for idx in allocators if allocators[idx].num_free >= need]
            local = [idx for idx in free if old_workers & set(new_instances[idx])]
            candidates = local or free
            if not candidates:
                raise ValueError(f"reshape {old} -> {new}: request {request.request_id!r} holds {need} KV blocks and "
                                 f"no new instance has that many free "
                                 f"({ {i: a.num_free for i, a in allocators.items()} })")
            dst = min(candidates, key=lambda idx: (allocators[idx].num_used / max(num_total[idx], 1), idx))
            placement.requests[dst].append(request)
            for seq in request.seqs:
                seq_moves[seq.seq_id] = (old_idx, dst)
                if seq.block_ids:
                    new_blocks = allocators[dst].allocate(len(seq.block_ids))
                    if dst in kept:
                        placement.taken_on_kept.append((allocators[dst], new_blocks))
                    moves.append(BlockMove(old_idx, dst, tuple(seq.block_ids), tuple(new_blocks)))
        transfers = build_migration_plan(moves, old, new, num_kv_heads)
        plan = ReshapePlan(old, new, moves, transfers, live_old, {idx: allocators[idx].num_used for idx in changing},
                           num_total, seq_moves, kept, weights_source)
    except BaseException:
        placement.release_taken()
        raise
    return plan, placement


def resume_instances(instances, new: Topology, plan: ReshapePlan, placement: RequestPlacement, make_instance):
    """The instances after the commit point: kept ones keep their engine and adopt the requests moved to them; the
    others get a new engine over their new allocator. make_instance(workers, allocator) builds one. Returns (new
    instances, prompt tokens computed by the retired engines)."""
    new_block_ids = {(m.src_instance, m.src_blocks): list(m.dst_blocks) for m in plan.moves}
    retired_prompt_tokens = sum(inst.engine.num_computed_prompt_tokens for idx, inst in enumerate(instances)
                                if idx not in plan.kept.values())
    out = []
    for idx, workers in enumerate(new.instances()):
        instance = instances[plan.kept[idx]] if idx in plan.kept else make_instance(workers, placement.allocators[idx])
        for request in placement.requests[idx]:
            blocks = {seq.seq_id: new_block_ids[(plan.seq_moves[seq.seq_id][0], tuple(seq.block_ids))]
                      for seq in request.seqs if seq.block_ids}
            instance.engine.adopt(request, blocks)
        out.append(instance)
    return out, retired_prompt_tokens


def run_reshape(deployment, target, weights_source: str | None = None) -> ReshapeReport:
    """Change the deployment's topology in place, e.g. [1, 1] -> [2] -> [1, 1]. Call between steps (the
    deployment's driver thread), which is the quiesce point. Raises ValueError for a topology that is not a
    candidate or a plan that does not fit, ReshapeAborted when a worker fails before the commit point; the old
    topology is then still serving."""
    new = parse_topology(target)
    old = deployment.topology
    if new not in deployment.candidates:
        raise ValueError(f"topology {new} is not a candidate for {deployment.config.num_workers} workers: "
                         f"{[str(t) for t in deployment.candidates]}")
    start = time.perf_counter()
    if new == old:
        return ReshapeReport(str(old), str(new), 0.0, True)
    # Scale-down refills shard chunks: over the GPU interconnect from peers is faster than host-to-device copies;
    # on CPU the shared host store is a plain memcpy and beats a loopback transfer.
    weights_source = weights_source or ("peers" if deployment.config.device.startswith("cuda") else "host")
    deployment.restore_full_precision(changing_workers(old, new))
    plan, placement = plan_reshape(deployment.instances, old, new, deployment.capacity,
                                   deployment.num_kv_heads, weights_source)
    pool = deployment.pool
    workers = list(range(deployment.config.num_workers))
    try:
        stats = pool.call_many(workers, RESHAPE_PHASES[0], plan)
        for phase in RESHAPE_PHASES[1:]:
            stats = pool.call_many(workers, phase)
    except WorkerError as exc:
        placement.release_taken()
        for w in workers:
            if w in pool.dead_workers():
                continue  # a dead worker has nothing to roll back; it is replaced below
            try:
                pool.call(w, "reshape.abort")
            except WorkerError as rollback_error:
                log.error("rollback on worker %d failed: %s", w, rollback_error)
        report = ReshapeReport(str(old), str(new), time.perf_counter() - start, False)
        deployment.on_reshape(report)
        deployment.recover()  # a worker that died before the commit point is replaced under the old topology
        raise ReshapeAborted(f"reshape {old} -> {new} rolled back: {exc}") from exc
    # ---- commit point: every worker holds the new shard, the migrated KV and the new groups ----
    lost = False
    try:
        pool.call_many(workers, "reshape.commit")
    except WorkerError:
        if not pool.dead_workers():
            raise
        lost = True
    deployment.resume(new, plan, placement)
    if lost:
        deployment.recover()  # after the commit point: replace the dead worker under the new topology
    report = ReshapeReport(str(old), str(new), time.perf_counter() - start, True, stats, len(plan.seq_moves))
    deployment.on_reshape(report)
    return report


def changing_workers(old: Topology, new: Topology) -> list[int]:
    """Workers whose instance is not the same before and after."""
    same = set(old.instances()) & set(new.instances())
    return sorted({w for ws in old.instances() + new.instances() if ws not in same for w in ws})
