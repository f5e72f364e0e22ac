"""Parameter drop plans (KunServe §4.1, Fig. 6), torch-free: which instance groups to merge into pipelines so that
the copies of the decoder layers they stop holding free enough memory for the queued requests, and how a merged
pipeline splits its layers over its stages.

Fig. 6 merges the two smallest groups until enough is freed: the performance lost grows with the stages a request
crosses (Fig. 5), so groups stay as small as possible. Our topologies lay instances over consecutive workers, so
only adjacent groups can merge: the greedy picks the adjacent pair with the smallest merged size (leftmost on a
tie). Two groups that each hold one full copy of the decoder layers hold one after the merge, so every merge frees
one copy (`layer_bytes`: all decoder layers of the model as one worker holds them, with the vocabulary tables the
merged stages stop reading)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DropPlan:
    groups: tuple[tuple[int, ...], ...]   # indices of the current groups forming each new group, in worker order
    new_sizes: tuple[int, ...]            # workers of each new group
    freed_bytes: int
    demand_bytes: int

    @property
    def covers_demand(self) -> bool:
        """False: every group merged and the demand still exceeds what that frees (the rest queues, §4.1)."""
        return self.freed_bytes >= self.demand_bytes


@dataclass(frozen=True, slots=True)
class DropRefusal:
    reason: str   # with the numbers: it goes to the log and a metric label


def plan_drop(group_sizes: list[int], layer_bytes: int, demand_bytes: int) -> DropPlan | DropRefusal:
    """Fig. 6 over adjacent groups. group_sizes: workers of each current group in worker order (1: a data-parallel
    instance with a full copy of the layers; n: an n-stage pipeline holding one copy). Like Fig. 6, which merges
    until the demand is met or no pair is left, a demand larger than merging every group frees still merges them
    all (the plan does not cover it: the rest waits in the KV-centric fallback, §4.1: queue or preempt, and scale
    out). A refusal (one group left, or nothing to free) sends the caller to that fallback alone."""
    if not group_sizes or any(size < 1 for size in group_sizes):
        raise ValueError(f"group sizes must be >= 1 workers each, got {list(group_sizes)}")
    if demand_bytes <= 0:
        return DropRefusal(f"nothing to free: demand is {demand_bytes} bytes")
    if layer_bytes <= 0:
        return DropRefusal(f"dropping frees nothing: the decoder layers hold {layer_bytes} bytes per copy")
    if len(group_sizes) == 1:
        return DropRefusal(f"one group of {group_sizes[0]} workers left: nothing to merge (demand {demand_bytes} "
                           f"bytes)")
    most = (len(group_sizes) - 1) * layer_bytes
    members = [(i,) for i in range(len(group_sizes))]
    sizes = list(group_sizes)
    freed = 0
    while freed < min(demand_bytes, most):
        # The adjacent pair with the smallest merged size; min() keeps the leftmost of equal pairs.
        i = min(range(len(sizes) - 1), key=lambda k: sizes[k] + sizes[k + 1])
        members[i:i + 2] = [members[i] + members[i + 1]]
        sizes[i:i + 2] = [sizes[i] + sizes[i + 1]]
        freed += layer_bytes
    return DropPlan(tuple(members), tuple(sizes), freed, demand_bytes)


def stage_split(num_layers: int, num_stages: int, layer_cost: float, head_cost: float,
                capacity: Callable[[tuple[int, ...]], int] | None = None, need_tokens: int = 0) -> tuple[int, ...]:
    """Decoder layers per stage of a merged pipeline that minimise the slowest stage, when the last stage also
    runs the final norm and the LM head (`head_cost`, in the unit of `layer_cost`): the last stage holds fewer
    layers. Every stage holds at least one. Among equally slow splits the most even wins (least sum of squared
    stage costs), then the one with the fewest layers on the last stage; the other stages differ by at most one
    layer, the earlier ones holding more (topology.split_layers when head_cost is 0).

    capacity(split): the KV tokens the pipeline would hold (its fullest stage's), need_tokens: what it must hold.
    A drop is for KV: only splits that hold need_tokens are considered, and when none does, the one that holds the
    most (KunServe §3 drops halves: a stage with more layers holds fewer tokens of each; on the default model the
    head-balanced 17/13 split holds 15 % less than 15/15, which a KV-bound burst pays in queueing)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"num_stages must be in [1, {num_layers}] to split {num_layers} layers, got {num_stages}")
    if layer_cost < 0 or head_cost < 0:
        raise ValueError(f"stage costs must be >= 0, got layer_cost={layer_cost} head_cost={head_cost}")
    if num_stages == 1:
        return (num_layers,)
    candidates = []
    for last in range(1, num_layers - num_stages + 2):
        base, extra = divmod(num_layers - last, num_stages - 1)
        split = tuple(base + (stage < extra) for stage in range(num_stages - 1)) + (last,)
        costs = [n * layer_cost for n in split[:-1]] + [last * layer_cost + head_cost]
        candidates.append((split, (max(costs), sum(c * c for c in costs), last)))
    if capacity is not None:
        held = {split: capacity(split) for split, _ in candidates}
        enough = [c for c in candidates if held[c[0]] >= need_tokens]
        if not enough:
            return min(candidates, key=lambda c: (-held[c[0]], c[1]))[0]
        candidates = enough
    return min(candidates, key=lambda c: c[1])[0]
