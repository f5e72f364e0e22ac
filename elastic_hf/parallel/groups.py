"""The process groups of every candidate topology, built once at start (ReMP §3.6 "MPU state space"): a reshape
switches to a prebuilt snapshot instead of creating communicators on the critical path."""
from __future__ import annotations

from elastic_hf.topology import Topology, group_rank_sets


class ProcessGroups:
    """All TP groups (instances, or stages of pipelined instances) of the candidate topologies of one worker;
    `for_topology` is the snapshot lookup. Pipeline stages talk point-to-point on global ranks: no group needed.
    `exchange`: a second group over the whole world for the KV exchange, which runs on a thread of its own beside
    the steps (parallel/worker_exchange.py): its transfers never queue on the communicator the activations use."""

    def __init__(self, topologies: list[Topology], backend: str):
        import torch.distributed as dist

        self.topologies = list(topologies)
        self.groups: dict[tuple[int, ...], object] = {}
        # new_group is collective over the whole world: every worker creates every group, in the same order.
        for ranks in group_rank_sets(self.topologies):
            self.groups[ranks] = dist.new_group(list(ranks), backend=backend)
        self.exchange = dist.new_group(list(range(dist.get_world_size())), backend=backend)

    def group(self, workers: tuple[int, ...]):
        if len(workers) == 1:
            return None
        if workers not in self.groups:
            raise ValueError(f"no process group for workers {workers}; prebuilt: {sorted(self.groups)}")
        return self.groups[workers]

    def for_topology(self, topology: Topology, worker: int):
        """(group, tp, rank) of `worker` in `topology` (its stage's TP group), or None in standby."""
        role = topology.role(worker)
        if role is None:
            return None
        return self.group(role.stage_workers), role.tp, role.rank
