"""Topologies of a deployment and the process groups for every candidate one, built once at start (ReMP §3.6
"MPU state space"): a transform switches to a prebuilt snapshot instead of creating communicators on the critical
path.

A topology is a tuple of TP degrees of instances laid over consecutive workers: (2, 1, 1) on 4 workers is one TP2
instance on workers 0-1 and two TP1 instances on workers 2 and 3. Workers not covered are in standby."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Topology:
    sizes: tuple[int, ...]

    def __post_init__(self):
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"a topology needs at least one instance of TP >= 1, got {self.sizes}")

    @property
    def num_workers(self) -> int:
        return sum(self.sizes)

    def instances(self) -> list[tuple[int, ...]]:
        """Worker ids of each instance, in order."""
        out, start = [], 0
        for size in self.sizes:
            out.append(tuple(range(start, start + size)))
            start += size
        return out

    def role(self, worker: int) -> tuple[int, int, int] | None:
        """(instance index, tp, rank) of a worker, or None when it is in standby."""
        for idx, workers in enumerate(self.instances()):
            if worker in workers:
                return idx, len(workers), workers.index(worker)
        return None

    def __str__(self) -> str:
        return "[" + ",".join(str(s) for s in self.sizes) + "]"


def parse_topology(value) -> Topology:
    """[1, 1], (2,), "1,1" or a Topology."""
    if isinstance(value, Topology):
        return value
    if isinstance(value, str):
        value = [int(v) for v in value.strip("[]() ").split(",") if v.strip()]
    return Topology(tuple(int(v) for v in value))


def candidate_topologies(num_workers: int, degrees: tuple[int, ...], with_standby: bool = False) -> list[Topology]:
    """Every way to cover the workers with instances of allowed degrees (N=2: [1,1], [2]; N=4: [1,1,1,1],
    [1,1,2], [1,2,1], [2,1,1], [2,2], [4]); with_standby adds layouts that leave the last workers in standby
    (N=2: [1])."""
    out: list[Topology] = []
    if with_standby:
        for active in range(1, num_workers):
            out.extend(candidate_topologies(active, degrees))

    def extend(prefix: tuple[int, ...], left: int) -> None:
        if left == 0:
            out.append(Topology(prefix))
            return
        for d in degrees:
            if d <= left:
                extend(prefix + (d,), left - d)

    extend((), num_workers)
    return out


def group_rank_sets(topologies: list[Topology]) -> list[tuple[int, ...]]:
    """Distinct multi-worker instances across the candidates, in a fixed order every worker agrees on."""
    sets = {workers for t in topologies for workers in t.instances() if len(workers) > 1}
    return sorted(sets, key=lambda w: (len(w), w))


class ProcessGroups:
    """All TP groups of the candidate topologies of one worker; `for_topology` is the snapshot lookup."""

    def __init__(self, topologies: list[Topology], backend: str):
        import torch.distributed as dist

        self.topologies = list(topologies)
        self.groups: dict[tuple[int, ...], object] = {}
        # new_group is collective over the whole world: every worker creates every group, in the same order.
        for ranks in group_rank_sets(self.topologies):
            self.groups[ranks] = dist.new_group(list(ranks), backend=backend)

    def group(self, workers: tuple[int, ...]):
        if len(workers) == 1:
            return None
        if workers not in self.groups:
            raise ValueError(f"no process group for workers {workers}; prebuilt: {sorted(self.groups)}")
        return self.groups[workers]

    def for_topology(self, topology: Topology, worker: int):
        """(group, tp, rank) of `worker` in `topology`, or None in standby."""
        role = topology.role(worker)
        if role is None:
            return None
        idx, tp, rank = role
        return self.group(topology.instances()[idx]), tp, rank
