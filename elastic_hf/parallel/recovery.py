"""Recovery from dead worker processes, executed between steps: the executor replaces them under the current
topology; the instances that lost a worker lost part of their KV and recompute their requests (preemption); every
other instance continues untouched."""
from __future__ import annotations

import logging

from elastic_hf.parallel.worker import Worker

log = logging.getLogger(__name__)

PEER_GRACE_S = 10.0   # a dead worker's peers still blocked on it after this are ended (gloo waits 120 s)


def replace_dead_workers(dep) -> list[int]:
    """Replace dead worker processes under the current topology. Requests of an instance that lost a worker lost
    part of their KV and are recomputed (preemption); every other instance continues untouched."""
    dead = dep.pool.check_health()
    if not dead:
        return []
    peers = sorted({w for i in dep.instances if set(i.workers) & set(dead) for w in i.workers} - set(dead))
    if dep.pool.end_blocked(peers, PEER_GRACE_S):
        dead = dep.pool.check_health()
    for inst in dep.instances:   # steps in flight on a lost worker did not happen; the others' finish
        if any(w in dead for w in inst.workers):
            inst.engine.batches.discard()
    dep.overload.on_workers_lost(dead)
    dep.pool.replace(dead, dep.topology.sizes)
    dep.drain_batches()
    for inst in dep.instances:
        lost = [w for w in inst.workers if w in dead]
        if not lost:
            continue
        inst.engine.preempt_running()   # with the requests stalled on a KV exchange
        capacity = dep.capacity(inst.key)
        dep.pool.collective_rpc(Worker.init_kv, (capacity,), lost)
        # Afresh at fp on every worker: morphs or a drop may have resized the survivors' pools.
        inst.engine.scheduler.kv.reset(capacity)
        for w in lost:
            if w in dep.morph_managers:
                dep.morph_managers[w].bind(None)
    dep.bind_morph()
    dep.num_recoveries += 1
    dep.deployment_metrics.recoveries.inc()
    log.warning("replaced dead workers %s; topology %s", dead, dep.topology)
    return dead
