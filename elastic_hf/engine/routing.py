"""Routing across instances and when to change their TP degree (Gyges §5 Alg. 1-2, AMOEBA §3.3), torch-free.

The deployment hands over a snapshot of every instance's KV load; the policy answers with a decision as data: an
instance to route to, or a target topology (a tuple of TP degrees over consecutive workers) to reshape into first.
The deployment executes it. Routers:
- "elastic": only instances that can hold the request (input + output blocks vs free blocks), fewest requests per
  worker first; long requests prefer instances already at TP > 1 (consecutive long requests reuse the merge), short
  ones see a merged instance as one request busier so that it drains and can split back;
- "least_load" and "round_robin": the baselines; with an elastic TP policy they scale up around the instance they
  picked when it cannot hold the request.
With prefix caching, "elastic" and "least_load" are cache-aware (SGLang's router, bounded by load): among the
instances whose KV load is within CACHE_AFFINITY_SLACK of their pick's, the one holding the longest cached prefix of
the request wins, so a conversation's turns return to the instance that holds its history."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from elastic_hf.config import EngineConfig

CACHE_AFFINITY_SLACK = 0.25   # KV-load fraction an instance may be above the pick and still win on cached prefix


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    index: int
    tp: int
    num_total_blocks: int
    num_used_blocks: int
    num_requests: int
    num_long: int            # running requests too long for a TP1 instance
    num_split_blocks: int = 0  # blocks of the two instances it would split into (0 at TP1)
    num_cached_blocks: int = 0   # full blocks of the request being routed that its prefix cache holds

    @property
    def num_free_blocks(self) -> int:
        return self.num_total_blocks - self.num_used_blocks

    @property
    def load(self) -> float:
        return self.num_used_blocks / max(self.num_total_blocks, 1)


@dataclass(frozen=True, slots=True)
class Admission:
    """Where a new request goes: `instance`, or first `merge_to` (a topology to reshape into), then ask again."""
    instance: int | None
    merge_to: tuple[int, ...] | None = None


class TPPolicy:
    def __init__(self, config: EngineConfig, degrees: tuple[int, ...] = (1, 2)):
        """Reads tp_policy, router and scale_down_load of the config; degrees: the TP degrees allowed."""
        self.tp_policy = config.tp_policy
        self.router = config.router
        self.scale_down_load = config.scale_down_load
        self.degrees = tuple(degrees)
        self._rr = itertools.count()

    @property
    def is_elastic(self) -> bool:
        return self.tp_policy == "elastic"

    def admit(self, loads: list[InstanceLoad], sizes: tuple[int, ...], num_blocks: int, is_long: bool,
              merge_failed: bool = False) -> Admission:
        """Routing plus scale-up (Gyges Alg. 1): route; when the pick cannot ever hold the request, or the elastic
        router wants a merged instance for a long request, merge two instances first (merge_to), unless a merge
        was just refused (merge_failed): then queue it on an instance that can ever hold it."""
        instance, fits_now = self.route(loads, num_blocks, is_long)
        never_fits = loads[instance].num_total_blocks < num_blocks
        wants_more = is_long and not fits_now and self.router == "elastic"
        if not (never_fits or wants_more):
            return Admission(instance)
        if not merge_failed:
            anchor = None if self.router == "elastic" else instance
            target = self.scale_up_target(sizes, loads, anchor)
            if target is None and anchor is not None:  # the baseline's pick has no equal neighbour
                target = self.scale_up_target(sizes, loads, None)
            if target is not None:
                return Admission(None, target)
        if never_fits:
            holders = [x for x in loads if x.num_total_blocks >= num_blocks]
            if holders:
                instance = min(holders, key=lambda x: (x.load, x.index)).index
        return Admission(instance)

    # ------------------------------------------------------------------ Alg. 1: routing
    def route(self, loads: list[InstanceLoad], num_blocks: int, is_long: bool) -> tuple[int, bool]:
        """(instance index, whether it can hold the request now). The baselines pick first and check after."""
        router = self.router
        if router == "round_robin":
            pick = loads[next(self._rr) % len(loads)]
            return pick.index, pick.num_free_blocks >= num_blocks
        if router == "least_load":
            pick = _prefer_cached(loads, min(loads, key=lambda x: (x.load, x.num_requests, x.index)))
            return pick.index, pick.num_free_blocks >= num_blocks
        fits = [x for x in loads if x.num_free_blocks >= num_blocks]
        if not fits:
            # Nothing holds it now: the least-loaded instance that could once others finish, else the largest.
            could = [x for x in loads if x.num_total_blocks >= num_blocks]
            if could:
                pick = min(could, key=lambda x: (x.load, x.index))
            else:
                pick = max(loads, key=lambda x: x.num_total_blocks)
            return pick.index, False
        if is_long:  # consecutive long requests: reuse an instance already at higher TP
            pick = min(fits, key=lambda x: (-x.tp, x.num_requests / x.tp, x.index))
        else:
            # Compute load decides (requests per worker: a merged instance's KV fraction looks small because its
            # capacity is large); a merged instance counts one request more so that it drains and splits back.
            pick = _prefer_cached(fits, min(fits, key=lambda x: ((x.num_requests + (x.tp > 1)) / x.tp, x.tp,
                                                                  x.index)))
        return pick.index, True

    # ------------------------------------------------------------------ scale-up (x2, least-loaded equal TP)
    def scale_up_target(self, sizes: tuple[int, ...], loads: list[InstanceLoad],
                        anchor: int | None = None) -> tuple[int, ...] | None:
        """Merge two adjacent instances of equal TP into one of twice the degree: the least-loaded pair, or the pair
        containing `anchor` (the baselines' pick). None when no merge is allowed."""
        if not self.is_elastic:
            return None
        pairs = []
        for i in range(len(sizes) - 1):
            if sizes[i] == sizes[i + 1] and 2 * sizes[i] in self.degrees:
                if anchor is None or anchor in (i, i + 1):
                    pairs.append((loads[i].load + loads[i + 1].load, -sizes[i], i))
        if not pairs:
            return None
        _, _, i = min(pairs)
        return sizes[:i] + (2 * sizes[i],) + sizes[i + 2:]

    # ------------------------------------------------------------------ Alg. 2: scale-down
    def scale_down_target(self, sizes: tuple[int, ...], loads: list[InstanceLoad]) -> tuple[int, ...] | None:
        """Split the first merged instance with no long request left, whose live blocks stay under the threshold
        fraction of the halves' capacity, in halves."""
        if not self.is_elastic:
            return None
        for i, x in enumerate(loads):
            # The live blocks must fit the halves with room to spare: scale-down is KV first, so each worker holds
            # its old head range and the new full-head copy until the commit point.
            fits = x.num_used_blocks < self.scale_down_load * x.num_split_blocks
            if x.tp > 1 and x.num_long == 0 and fits and x.tp // 2 in self.degrees:
                half = x.tp // 2
                return sizes[:i] + (half, half) + sizes[i + 1:]
        return None


def _prefer_cached(candidates: list[InstanceLoad], pick: InstanceLoad) -> InstanceLoad:
    """The candidate holding the longest cached prefix of the request among those whose KV load is at most
    CACHE_AFFINITY_SLACK above the pick's; the pick itself when none holds more than it."""
    near = [x for x in candidates if x.load <= pick.load + CACHE_AFFINITY_SLACK]
    best = max(near, key=lambda x: (x.num_cached_blocks, x is pick), default=pick)
    return best if best.num_cached_blocks > pick.num_cached_blocks else pick
