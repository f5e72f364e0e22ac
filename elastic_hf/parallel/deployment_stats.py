"""Read-only views of a deployment for metrics and `stats()`: totals over every instance engine."""
from __future__ import annotations

from elastic_hf.engine.routing import InstanceLoad
from elastic_hf.topology import InstanceShape

TOTALS = ("kv_blocks_used", "kv_blocks_total", "num_waiting", "num_running", "num_exchanging", "num_requests",
          "num_steps", "num_preemptions", "prefix_cache_blocks", "prefix_cache_free_blocks",
          "prefix_cache_queried_tokens", "prefix_cache_hit_tokens")


def load_totals(instances) -> tuple[int, int, int, int]:
    """KV blocks used and attached, waiting and running sequences over every instance (EngineMetrics.load_totals:
    kv_cache_usage_perc is used / attached over all of them). Sequences stalled on a KV exchange count as running:
    they hold their blocks and belong to the running batch."""
    schedulers = [i.engine.scheduler for i in instances]
    return (sum(s.kv.num_used for s in schedulers), sum(s.kv.num_total for s in schedulers),
            sum(len(s.waiting) for s in schedulers), sum(len(s.running) + len(s.exchanging) for s in schedulers))


def instance_loads(instances, capacity, long_request_ids: set[str], prompt_hashes: list | None = None
                   ) -> list[InstanceLoad]:
    """What the routing policy reads of each instance: KV capacity and use, requests, long ones, the KV its
    halves would hold after a split (capacity(key) of a (workers, shape) key), and with `prompt_hashes` (the
    lookup hashes of a request being routed, kv/prefix_cache.py) how many of its blocks its prefix cache holds."""
    out = []
    for idx, inst in enumerate(instances):
        kv = inst.engine.scheduler.kv
        cached = len(kv.lookup_prefix(prompt_hashes)) if prompt_hashes else 0
        num_long = sum(1 for r in inst.engine.requests if r in long_request_ids)
        half = inst.tp // 2 if inst.shape.pp == 1 else 0   # the elastic TP policy splits TP instances only
        split = sum(capacity((ws, InstanceShape(half))) for ws in (inst.workers[:half], inst.workers[half:])) \
            if half else 0
        out.append(InstanceLoad(idx, inst.tp, kv.num_total, kv.num_used, len(inst.engine.requests), num_long, split,
                                cached))
    return out


def deployment_stats(deployment) -> dict:
    per_instance = [{"workers": list(i.workers), **i.engine.stats()} for i in deployment.instances]
    totals = {key: sum(i[key] for i in per_instance) for key in TOTALS}
    for key in ("num_steps", "num_preemptions", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens"):
        totals[key] += deployment.retired[key]   # engines replaced by a reshape keep counting
    totals["prefix_cache_dropped_blocks"] = deployment.retired["prefix_cache_dropped_blocks"]
    queried = totals["prefix_cache_queried_tokens"]
    totals["prefix_cache_hit_rate"] = round(totals["prefix_cache_hit_tokens"] / queried, 4) if queried else 0.0
    committed = [r.committed for r in deployment.reshapes]
    return {**totals, "topology": str(deployment.topology),
            "num_computed_prompt_tokens": deployment.num_computed_prompt_tokens,
            "num_reshapes": sum(committed), "num_rolled_back": len(committed) - sum(committed),
            "reshape_seconds": [round(r.seconds, 4) for r in deployment.reshapes if r.committed],
            "num_moved_requests": deployment.balancer.num_moved, "instances": per_instance}
