"""A restore's KV copied ahead of its commit, beside the steps (the second half of restore_prewarm.py).

Once a restore's layers are loaded, the placement the restore would make now is planned (plan_reshape): every
running request gets its new instance and its blocks on that instance's new KV manager. The blocks a sequence has
filled (num_computed_tokens // block_size) are never written again, so their KV is copied now into pools the
workers make for the restored layout, on each worker's exchange thread (worker_exchange.py, the serving pool stays
open), held to the configured share of a core while steps run. The restore's commit then plans with the same KV
managers (reshape.PreCopy): requests still valid keep their instance and blocks, and its transfers move only the
blocks that filled or began since (a few per request), so its stop-the-world part no longer grows with the context
of the running requests. The new pools' pages come from free KV blocks of the serving instances, like the layers';
when they do not cover them, or the pipeline would be left with fewer free blocks than it has running sequences,
nothing is copied and the commit moves everything, as before."""
from __future__ import annotations

import logging

from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan, check_plan
from elastic_hf.parallel.reshape import PinnedSeq, PreCopy, plan_reshape
from elastic_hf.units import ceil_div

log = logging.getLogger(__name__)

SPARE_BLOCKS = 2   # blocks share pages at their ends: a couple more than the bytes say


def plan_precopy(dep, target) -> tuple[PreCopy, list[BlockMove], dict[int, int]] | None:
    """The placement the restore to `target` would make now, pinned: (PreCopy, the full blocks' moves, blocks each
    worker's new pool needs). None when the restore could not place the running requests now."""
    old = dep.topology
    try:
        plan, placement = plan_reshape(dep.instances, old, target, dep.capacity, dep.num_kv_heads, dep.num_layers,
                                       "host")
    except ValueError as exc:
        log.info("no restore KV pre-copy: %s", exc)
        return None
    if any(placement.requests[idx] for idx in plan.kept):
        # A request would go to an instance that stays as it is (its own pool, serving): not copied ahead
        placement.release_taken()
        log.info("no restore KV pre-copy: requests would move to unchanged instances %s", sorted(plan.kept))
        return None
    bs = dep.config.block_size
    pinned: dict[int, PinnedSeq] = {}
    copies: list[BlockMove] = []
    for dst, requests in placement.requests.items():
        for request in requests:
            for seq in request.seqs:
                if not seq.block_ids:
                    continue
                src = plan.seq_moves[seq.seq_id][0]
                ids = placement.new_blocks[seq.seq_id]
                full = min(seq.num_computed_tokens // bs, len(seq.block_ids))
                pinned[seq.seq_id] = PinnedSeq(dst, tuple(seq.block_ids[:full]), tuple(ids), seq.num_preemptions)
                if full:
                    copies.append(BlockMove(src, dst, tuple(seq.block_ids[:full]), tuple(ids[:full])))
    managers = {idx: kv for idx, kv in placement.kv_managers.items() if idx not in plan.kept}
    pool_blocks = {w: plan.num_live_new_blocks[idx] for idx, workers in enumerate(target.instances())
                   if idx in managers for w in workers}
    return PreCopy(managers, pinned), copies, pool_blocks


def start_precopy(dep, target, cpu_share: float, footprints: list[dict]
                  ) -> tuple[PreCopy, list[tuple[object, int]], int, list[int]] | None:
    """Plan the copy, give the serving KV managers' free blocks for the new pools, and start the copy on the workers
    of the changing instances (`footprints`: every worker's reshape_footprint to target, as the prewarm asked).
    Returns (PreCopy, the blocks given back per KV manager, blocks copied, the workers that copy), or None with
    nothing changed."""
    planned = plan_precopy(dep, target)
    if planned is None:
        return None
    precopy, copies, pool_blocks = planned
    if not copies:
        return None
    workers = list(range(dep.config.num_workers))
    pool = dep.pool
    reports = dep.memory_report()
    need = {}
    for w, fp, r in zip(workers, footprints, reports):
        pages = ceil_div(pool_blocks.get(w, 0) * fp["new_block_bytes"], fp["page_size"]) + 1
        need[w] = pages * fp["page_size"] - (r["free_bytes"] - r["headroom_bytes"])
    # The pipeline keeps serving meanwhile: it keeps a free block for every sequence it runs
    shrunk = free_kv_blocks(dep, need, reports, "restore KV pre-copy", keep_one_per_running=True)
    if shrunk is None:
        return None
    transfers = build_migration_plan(copies, dep.topology, target, dep.num_kv_heads, dep.num_layers)
    check_plan(copies, transfers, dep.topology, target, dep.num_kv_heads, dep.num_layers)
    copying = sorted(pool_blocks)
    # Two phases: every worker makes its pool first, and only when all did does any transfer start (a worker
    # that failed would leave its peers waiting in a transfer it never posts).
    try:
        pool.call_many(copying, "reshape.precopy", target, pool_blocks, transfers)
    except Exception as exc:   # noqa: BLE001 - a worker that could not make its pool: the commit moves it all
        log.warning("restore KV pre-copy did not start: %s", exc)
        dead = pool.check_health()
        for w in copying:
            if w not in dead:
                _best_effort(dep, w, "reshape.drop_precopy")   # nothing started: no transfer to wait for
        give_back(shrunk)
        return None
    try:
        pool.call_many(copying, "exchange.start", cpu_share)
    except Exception as exc:   # noqa: BLE001 - as above, but some may be moving already
        log.warning("restore KV pre-copy did not start: %s", exc)
        abandon(dep, [w for w in copying if w not in pool.check_health()])
        give_back(shrunk)
        return None
    copied = sum(len(m.src_blocks) for m in copies)
    log.info("restore KV pre-copy: %d full blocks of %d sequences copied beside the steps", copied,
             len(precopy.pinned))
    return precopy, shrunk, copied, copying


def free_kv_blocks(dep, need: dict[int, int], reports: list[dict], purpose: str,
                   keep_one_per_running: bool = False) -> list[tuple[object, int]] | None:
    """Every instance's KV manager gives back free blocks covering need[w] bytes on each of its workers (never a
    live block; keep_one_per_running: never below one free block per running sequence). Returns (KV manager, blocks
    given) per instance, or None with everything grown back when the free blocks do not cover it."""
    shrunk: list[tuple[object, int]] = []
    for inst in dep.instances:
        blocks = max((ceil_div(need[w], reports[w]["kv_block_bytes"]) + SPARE_BLOCKS
                      for w in inst.workers if need[w] > 0 and reports[w]["kv_block_bytes"]), default=0)
        if blocks == 0:
            continue
        kv = inst.engine.scheduler.kv
        free = kv.num_free
        keep = len(inst.engine.scheduler.running) if keep_one_per_running else 0
        shrunk.append((kv, len(kv.shrink(blocks)) if free - blocks >= keep else 0))
        if shrunk[-1][1] < blocks:
            log.info("no %s: instance %s has %d free KV blocks, it needs %d and keeps %d free", purpose,
                     inst.workers, free, blocks, keep)
            give_back(shrunk)
            return None
    return shrunk


def abandon(dep, workers: list[int]) -> None:
    """The copy stops where it is (a peer died, or a transfer failed); its pools go. Every worker is told to stop
    after its current layer before any is waited for: the layers' transfers pair up across the workers."""
    for w in workers:
        _best_effort(dep, w, "exchange.stop")
    for w in workers:
        _best_effort(dep, w, "reshape.drop_precopy", True)


def _best_effort(dep, worker: int, method: str, *args) -> None:
    try:
        dep.pool.call(worker, method, *args)
    except Exception as exc:   # noqa: BLE001 - best effort: recovery replaces what fails here
        log.error("worker %d: %s failed: %s", worker, method, exc)


def give_back(shrunk: list[tuple[object, int]]) -> None:
    """The KV managers grow back by the blocks they gave."""
    for kv, n in shrunk:
        if n:
            kv.grow(n)
