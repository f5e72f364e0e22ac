"""Topologies of a deployment (torch-free). A topology lays instances over consecutive workers; an instance is
`tp x pp`: `pp` pipeline stages, each a tensor-parallel group of `tp` workers holding a range of decoder layers.

    [2, 1, 1]   one TP2 instance on workers 0-1, two TP1 instances on workers 2 and 3
    [1x2, 1]    a two-stage pipeline (TP1 per stage) on workers 0-1, a TP1 instance on worker 2
    [2x2]       two stages of TP2: stage 0 on workers 0-1, stage 1 on workers 2-3
    [1x2:16/14] a pipeline whose first stage holds 16 layers and the second 14 (the LM head stage fewer)

Workers not covered are in standby. A pure tensor-parallel instance is written as its degree (an int) everywhere, so
`Topology.sizes` of a TP-only layout is a tuple of ints; a pipelined instance is an `InstanceShape`. Every candidate
topology gets its process groups at start (parallel/groups.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

_SHAPE = re.compile(r"^(\d+)(?:x(\d+))?(?::(\d+(?:/\d+)*))?$")


def split_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    """Layers per stage of an even split; when `pp` does not divide them the first stages take one more, so the
    last stage (which also runs the final norm and the LM head) holds fewer."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp must be in [1, {num_layers}] to split {num_layers} layers, got {pp}")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (stage < extra) for stage in range(pp))


@dataclass(frozen=True, slots=True)
class InstanceShape:
    """One instance: `pp` stages of `tp` workers; `split`: layers per stage (None: even, see split_layers)."""
    tp: int
    pp: int = 1
    split: tuple[int, ...] | None = None

    def __post_init__(self):
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"an instance needs tp >= 1 and pp >= 1, got tp={self.tp} pp={self.pp}")
        if self.split is not None:
            object.__setattr__(self, "split", tuple(int(n) for n in self.split))
            if len(self.split) != self.pp or any(n < 1 for n in self.split):
                raise ValueError(f"a layer split of a {self.pp}-stage pipeline needs {self.pp} counts >= 1 (no empty "
                                 f"stage), got {'/'.join(map(str, self.split))}")

    @property
    def num_workers(self) -> int:
        return self.tp * self.pp

    def stage_bounds(self, num_layers: int) -> list[tuple[int, int]]:
        """[start, end) decoder layers of every stage."""
        counts = self.split if self.split is not None else split_layers(num_layers, self.pp)
        if sum(counts) != num_layers:
            raise ValueError(f"layer split {'/'.join(map(str, counts))} covers {sum(counts)} layers; the model has "
                             f"{num_layers}")
        bounds, start = [], 0
        for n in counts:
            bounds.append((start, start + n))
            start += n
        return bounds

    def without_split(self) -> "InstanceShape":
        return InstanceShape(self.tp, self.pp)

    def __str__(self) -> str:
        if self.pp == 1 and self.split is None:
            return str(self.tp)
        return f"{self.tp}x{self.pp}" + ("" if self.split is None else ":" + "/".join(map(str, self.split)))


class WorkerRole(NamedTuple):
    """Where a worker serves: instance index, TP degree and rank inside its stage, then the pipeline position."""
    instance: int
    tp: int
    rank: int
    pp: int = 1
    stage: int = 0
    stage_workers: tuple[int, ...] = ()   # the TP group of its stage

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pp - 1


def parse_shape(value) -> InstanceShape:
    """2, "2", "1x2", "1x2:16/14" or an InstanceShape."""
    if isinstance(value, InstanceShape):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return InstanceShape(value)
    text = str(value).strip().strip("'\"")
    match = _SHAPE.match(text)
    if match is None:
        raise ValueError(f"an instance is TP (e.g. 2), TPxPP (e.g. 1x2) or TPxPP:layers/per/stage (e.g. 1x2:16/14), "
                         f"got {value!r}")
    tp, pp, split = int(match[1]), int(match[2] or 1), match[3]
    return InstanceShape(tp, pp, tuple(int(n) for n in split.split("/")) if split else None)


def _canonical(shape: InstanceShape):
    return shape.tp if shape.pp == 1 and shape.split is None else shape


@dataclass(frozen=True, slots=True)
class Topology:
    sizes: tuple   # per instance: its TP degree (int) when it has one stage, else its InstanceShape

    def __post_init__(self):
        if not self.sizes:
            raise ValueError("a topology needs at least one instance")
        object.__setattr__(self, "sizes", tuple(_canonical(parse_shape(s)) for s in self.sizes))

    @property
    def shapes(self) -> tuple[InstanceShape, ...]:
        return tuple(parse_shape(s) for s in self.sizes)

    @property
    def is_tensor_only(self) -> bool:
        """True when no instance is pipelined (the elastic TP policy reasons over such layouts only)."""
        return all(isinstance(s, int) for s in self.sizes)

    @property
    def num_workers(self) -> int:
        return sum(shape.num_workers for shape in self.shapes)

    def instances(self) -> list[tuple[int, ...]]:
        """Worker ids of each instance, in order (stage 0's TP group first)."""
        out, start = [], 0
        for shape in self.shapes:
            out.append(tuple(range(start, start + shape.num_workers)))
            start += shape.num_workers
        return out

    def instance_keys(self) -> list[tuple[tuple[int, ...], InstanceShape]]:
        """(workers, shape) of each instance: what makes an instance the same before and after a reshape (a TP2
        and a 1x2 instance share their workers but not their layout)."""
        return list(zip(self.instances(), self.shapes))

    def stages(self, instance: int) -> list[tuple[int, ...]]:
        """The TP group of every stage of an instance."""
        shape, workers = self.shapes[instance], self.instances()[instance]
        return [workers[s * shape.tp:(s + 1) * shape.tp] for s in range(shape.pp)]

    def role(self, worker: int) -> WorkerRole | None:
        """The worker's place, or None when it is in standby."""
        for idx, workers in enumerate(self.instances()):
            if worker in workers:
                shape = self.shapes[idx]
                stage, rank = divmod(workers.index(worker), shape.tp)
                return WorkerRole(idx, shape.tp, rank, shape.pp, stage, self.stages(idx)[stage])
        return None

    def layer_range(self, worker: int, num_layers: int) -> tuple[int, int] | None:
        """[start, end) decoder layers the worker holds, or None in standby."""
        role = self.role(worker)
        if role is None:
            return None
        return self.shapes[role.instance].stage_bounds(num_layers)[role.stage]

    def check_layers(self, num_layers: int) -> None:
        """Raises ValueError when a pipelined instance cannot split the model's layers as asked."""
        for shape in self.shapes:
            shape.stage_bounds(num_layers)

    def without_splits(self) -> "Topology":
        """The same layout with even layer splits: candidates are enumerated without splits."""
        return Topology(tuple(s.without_split() for s in self.shapes))

    def __str__(self) -> str:
        return "[" + ",".join(str(s) for s in self.sizes) + "]"


def parse_topology(value) -> Topology:
    """[1, 1], (2,), ["1x2", 1], "1,1", "[2,1x2]", "1x2:16/14,1" or a Topology."""
    if isinstance(value, Topology):
        return value
    if isinstance(value, str):
        value = [v for v in value.strip().strip("[]() ").split(",") if v.strip()]
    elif isinstance(value, (int, InstanceShape)):
        value = [value]
    return Topology(tuple(parse_shape(v) for v in value))


def candidate_topologies(num_workers: int, degrees: tuple[int, ...], with_standby: bool = False,
                         max_pp: int = 1) -> list[Topology]:
    """Every way to cover the workers with instances of tp in `degrees` and pp <= max_pp (N=2, max_pp=2: [1,1],
    [1x2], [2]; N=4 adds [2,2], [2x2], [1x4], [2,1x2], ...); with_standby adds layouts that leave the last workers
    in standby (N=2: [1]). Layer splits are not enumerated: any split of a candidate's shapes is allowed."""
    out: list[Topology] = []
    if with_standby:
        for active in range(1, num_workers):
            out.extend(candidate_topologies(active, degrees, max_pp=max_pp))
    shapes = [InstanceShape(tp, pp) for pp in range(1, max_pp + 1) for tp in degrees]

    def extend(prefix: tuple[InstanceShape, ...], left: int) -> None:
        if left == 0:
            out.append(Topology(prefix))
            return
        for shape in shapes:
            if shape.num_workers <= left:
                extend(prefix + (shape,), left - shape.num_workers)

    extend((), num_workers)
    return out


def group_rank_sets(topologies: list[Topology]) -> list[tuple[int, ...]]:
    """Distinct multi-worker TP groups (a TP instance, or one stage of a pipelined one) across the candidates, in a
    fixed order every worker agrees on."""
    sets = {stage for t in topologies for idx in range(len(t.sizes)) for stage in t.stages(idx) if len(stage) > 1}
    return sorted(sets, key=lambda w: (len(w), w))
