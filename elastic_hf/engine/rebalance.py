"""Queue rebalancing across the instances of a deployment, torch-free: requests that have not started yet move, at
a step boundary, to an instance that would start them sooner.

Routing binds a request to an instance on arrival (engine/routing.py) by what the instances hold then: requests and
KV. It cannot know how long each one will take to prefill, so in a burst one instance's queue can hold several long
prompts while the other's drains: with one queue per worker, a request waits for its own instance's backlog even
when the other worker idles (two M/M/1 queues instead of one M/M/2). A static pipeline of the same workers has one
queue, and its tail TTFT under a compute burst was half data parallelism's (benchmarks/RESULTS.md, session 52).
Moving only requests with nothing computed costs no KV copy: a waiting request holds no blocks (the scheduler
allocates them chunk by chunk on admission), so the move is bookkeeping.

When a request would start: each step an instance spends its token budget on its running sequences first (one token
per decoding row, the rest of a prompt being prefilled), then admits waiting ones in admission order (the scheduler
keeps that order when it adopts a request). Its backlog drains at (budget - decoding rows) tokens a step, a step of n
workers taking 1/n of one worker's time (TP shards a step, a pipeline overlaps micro-batches). The plan is list
scheduling of one pooled queue: every waiting request, oldest first, goes to the instance where its prefill would be
done first given what went before it; it moves only when that is more than half a step earlier than where it
is (no churn on rounding) and the instance's free KV holds it whole beside the requests already placed there. A request
whose prefix is cached at its instance counts only the uncached tokens there, so the prefix cache's affinity holds
unless the backlog outweighs it. Requests that cannot move (started, pinned) still count in their instance's queue."""
from __future__ import annotations

from dataclasses import dataclass, field

MIN_DRAIN_SHARE = 0.25   # an instance whose decoding rows fill its budget still admits at this share of it
# A move must bring a request's prefill forward by more than this (in steps of one worker): moves that only shave
# rounding off the estimates would churn between step boundaries.
MOVE_MARGIN_STEPS = 0.5


@dataclass(slots=True)
class QueuedRequest:
    request_id: str
    instance: int               # where it waits now
    order: int                  # admission order (its first sequence's id): where it queues on any instance
    tokens: int                 # tokens left to prefill over its sequences
    blocks: int                 # KV blocks its whole input and output need
    movable: bool = True        # False: it stays (started, pinned to its instance, long on a merged instance)
    cached_tokens: dict[int, int] = field(default_factory=dict)   # instance index -> tokens its prefix cache holds


@dataclass(slots=True)
class InstanceQueue:
    index: int
    num_workers: int
    budget: int                 # tokens per step
    decode_rows: int            # running sequences that take one token a step
    prefill_tokens: int         # prompt tokens left of its running sequences
    free_blocks: int
    total_blocks: int

    def drain_rate(self) -> float:
        """Tokens of backlog worked off per step of one worker."""
        left = max(self.budget - self.decode_rows, self.budget * MIN_DRAIN_SHARE)
        return left * self.num_workers

    def cost(self, request: QueuedRequest) -> int:
        return max(request.tokens - request.cached_tokens.get(self.index, 0), 0)


@dataclass(frozen=True, slots=True)
class Move:
    request_id: str
    source: int
    target: int
    gain_steps: float           # how much earlier its prefill is done, in steps of one worker


def imbalanced(queues: list[InstanceQueue], waiting: list[QueuedRequest]) -> bool:
    """Whether any move could pay: the instances' backlogs (prefix caches aside) end more than the margin apart.
    A cheap test before the prefix-cache lookups a plan needs."""
    backlog = {q.index: float(q.prefill_tokens) for q in queues}
    for request in waiting:
        backlog[request.instance] += request.tokens
    ends = [backlog[q.index] / q.drain_rate() for q in queues]
    return max(ends) - min(ends) > MOVE_MARGIN_STEPS


def plan_moves(queues: list[InstanceQueue], waiting: list[QueuedRequest], max_moves: int = 32) -> list[Move]:
    """The moves to make at this step boundary (list scheduling of the pooled queue, module docstring). waiting:
    every waiting request of every instance. At most max_moves, the oldest requests first."""
    by_index = {q.index: q for q in queues}
    free_at = {q.index: q.prefill_tokens / q.drain_rate() for q in queues}   # steps until its running prefill is done
    placed_blocks = {q.index: 0 for q in queues}
    moves: list[Move] = []
    for request in sorted(waiting, key=lambda r: r.order):
        here = by_index[request.instance]
        done_here = free_at[here.index] + here.cost(request) / here.drain_rate()
        chosen, done = here, done_here
        if request.movable and len(moves) < max_moves:
            for q in queues:
                if q is here or q.total_blocks < request.blocks \
                        or q.free_blocks - placed_blocks[q.index] < request.blocks:
                    continue
                finish = free_at[q.index] + q.cost(request) / q.drain_rate()
                if finish < done_here - MOVE_MARGIN_STEPS and finish < done:
                    chosen, done = q, finish
        free_at[chosen.index] = done
        placed_blocks[chosen.index] += request.blocks
        if chosen is not here:
            moves.append(Move(request.request_id, here.index, chosen.index, round(done_here - done, 3)))
    return moves
