"""Topologies of a deployment (torch-free): a topology is a tuple of TP degrees of instances laid over consecutive
workers. (2, 1, 1) on 4 workers is one TP2 instance on workers 0-1 and two TP1 instances on workers 2 and 3. Workers
not covered are in standby. Every candidate topology gets its process groups at start (parallel/groups.py)."""
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
