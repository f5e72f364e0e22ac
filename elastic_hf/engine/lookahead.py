"""Lookahead micro-batch formulation (KunServe §4.3, Fig. 10-11), torch-free: cut one step's work into micro-batches
of equal *cost* (engine/cost_model.py, eq. 1-3) instead of equal token counts.

The step's sequences, in the step's order, form one token stream. A micro-batch is a contiguous span of it, so
concatenating the micro-batches gives the stream back (the logits keep the inputs' order) and the pieces of a
sequence stay in order. Splitting a span cuts it where its two sides cost the same: a piece of a sequence starts
at the sequence's prefix plus its offset, so a later piece of one prompt costs more than an earlier one of the
same length (its attention covers the earlier piece), which token counting cannot see. A decode (one token) has
no interior cut and is never split.

How many micro-batches: `lookahead_split` cuts `num_stages` by default, the count the token-count baseline uses
(instance_runner.split_micro_batches), and a micro-batch never has fewer than `min_tokens` tokens (MIN of Fig. 11)
unless the whole step has. `cost_chosen_split` (what a pipelined instance uses) lets the cost model choose the
count: the one with the least predicted pipeline time, where every further micro-batch shortens the fill and
drain of the pipe but pays the fixed costs again (lam and gamma of eq. 3, one activation transfer)."""
from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import NamedTuple

from elastic_hf.engine.cost_model import Chunk, CostModel


class WorkItem(NamedTuple):
    prefix: int      # tokens of the sequence already in the KV cache
    tokens: int      # new tokens of the sequence in this step
    sampled: bool    # its last token goes through the LM head


class Piece(NamedTuple):
    item: int        # index into the step's items
    start: int       # [start, end): token offsets within the item's new tokens
    end: int


MicroBatches = list[list[Piece]]


class _Stream:
    """The step's items as one token stream with spans [lo, hi) of global token offsets."""

    def __init__(self, items: list[WorkItem]):
        self.items = [WorkItem(*item) for item in items]
        for i, item in enumerate(self.items):
            if item.tokens < 1 or item.prefix < 0:
                raise ValueError(f"item {i} needs tokens >= 1 and prefix >= 0, got {tuple(item)}")
        self.starts = [0, *accumulate(item.tokens for item in self.items)]   # starts[i]: offset of item i
        self.total = self.starts[-1]

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        out = []
        i = bisect_right(self.starts, lo) - 1
        while i < len(self.items) and self.starts[i] < hi:
            base = self.starts[i]
            out.append(Piece(i, max(lo, base) - base, min(hi, self.starts[i + 1]) - base))
            i += 1
        return out


def piece_chunks(pieces: list[Piece], items: list[WorkItem]) -> list[Chunk]:
    """The cost model's view of a micro-batch: a piece starts after its item's prefix and earlier pieces."""
    return [Chunk(items[p.item].prefix + p.start, p.end - p.start,
                  bool(items[p.item].sampled) and p.end == items[p.item].tokens) for p in pieces]


def lookahead_split(items: list[WorkItem], model: CostModel, num_stages: int, min_tokens: int | None = None,
                    layer_fraction: float = 1.0, max_micro_batches: int | None = None) -> MicroBatches:
    """Fig. 11 on one step: `items` (prefix, tokens, sampled) in the step's order -> micro-batches of pieces in
    stream order. min_tokens: MIN (default the model's); max_micro_batches: default num_stages. Costs are those of
    the last stage (`layer_fraction` of the layers plus the LM head rows): the stage every micro-batch ends on."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    stream = _Stream(items)
    minimum = model.min_tokens if min_tokens is None else min_tokens
    if minimum < 1:
        raise ValueError(f"min_tokens must be >= 1, got {minimum}")
    if stream.total == 0:
        return []

    def cost(lo: int, hi: int) -> float:
        return model.batch_cost(piece_chunks(stream.pieces(lo, hi), stream.items), layer_fraction)

    def split(lo: int, hi: int, count: int) -> list[tuple[int, int]]:
        # Divide and conquer (Fig. 11, lines 7-10): a power of two halves at 0.5 * cost; another count cuts at
        # left/count of the cost, so every final micro-batch gets the same share.
        if count == 1:
            return [(lo, hi)]
        left = count // 2
        cut = _balanced_cut(cost, lo, hi, left, count - left, minimum)
        return split(lo, cut, left) + split(cut, hi, count - left)

    count = max(1, min(max_micro_batches or num_stages, stream.total // minimum))
    return [stream.pieces(lo, hi) for lo, hi in split(0, stream.total, count)]


def _balanced_cut(cost, lo: int, hi: int, left: int, right: int, minimum: int) -> int:
    """The cut t of [lo, hi) where cost(lo, t) / left is closest to cost(t, hi) / right, with room for `left` and
    `right` micro-batches of at least `minimum` tokens on either side. cost(lo, t) never falls and cost(t, hi)
    never grows as t grows (eq. 1-3 with non-negative coefficients), so a binary search finds it."""
    def excess(t: int) -> float:
        return cost(lo, t) * right - cost(t, hi) * left

    first, last = lo + left * minimum, hi - right * minimum
    a, b = first, last
    while a < b:   # the first t with excess(t) >= 0 (or `last`)
        mid = (a + b) // 2
        if excess(mid) >= 0:
            b = mid
        else:
            a = mid + 1
    if a > first and abs(excess(a - 1)) < abs(excess(a)):
        return a - 1
    return a


def pipeline_time(costs: list[float], num_stages: int) -> float:
    """Predicted seconds of one drained pipelined step whose micro-batches cost `costs` on a stage: the last
    micro-batch leaves the pipe after every micro-batch passed one stage and the slowest passed the others."""
    return sum(costs) + (num_stages - 1) * max(costs) if costs else 0.0


def cost_chosen_split(items: list[WorkItem], model: CostModel, num_stages: int, layer_fraction: float = 1.0,
                      max_micro_batches: int | None = None) -> MicroBatches:
    """The lookahead split whose micro-batch count minimises the predicted pipeline time (pipeline_time), among
    1 .. max_micro_batches (default 2 x num_stages): every further micro-batch shortens the pipe's fill and drain
    but pays the fixed costs of a forward again (gamma and lam of eq. 3: on a CPU mostly the weight stream), so a
    decode-only step is cut once its token work outweighs that, and a small step stays whole. MIN does not bound
    the count here: the fixed costs it stands for are in the prediction."""
    stream_total = sum(WorkItem(*item).tokens for item in items)
    if stream_total == 0:
        return []
    best, best_time = None, None
    for count in range(1, min(max_micro_batches or 2 * num_stages, stream_total) + 1):
        split = lookahead_split(items, model, count, min_tokens=1, layer_fraction=layer_fraction,
                                max_micro_batches=count)
        predicted = pipeline_time(predicted_costs(split, items, model, layer_fraction), num_stages)
        if best_time is None or predicted < best_time * (1 - 1e-9):
            best, best_time = split, predicted
    return best


def token_count_split(items: list[WorkItem], num_stages: int) -> MicroBatches:
    """The baseline (Sarathi-style token-count chunking): cut the stream into min(num_stages, tokens) spans of
    equal token counts, whatever the spans cost. Same output type as lookahead_split."""
    stream = _Stream(items)
    count = min(num_stages, stream.total)
    if count <= 0:
        return []
    cuts = [round(stream.total * k / count) for k in range(count + 1)]
    return [stream.pieces(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def predicted_costs(micro_batches: MicroBatches, items: list[WorkItem], model,
                    layer_fraction: float = 1.0) -> list[float]:
    """Predicted seconds of each micro-batch on the last stage (model: CostModel or cost_model.TokenLinearModel)."""
    items = [WorkItem(*item) for item in items]
    return [model.batch_cost(piece_chunks(mb, items), layer_fraction) for mb in micro_batches]


def balance(costs: list[float]) -> float:
    """max / min micro-batch cost: 1.0 is perfectly balanced; the slowest micro-batch sets every stage's pace."""
    if not costs:
        return 1.0
    low = min(costs)
    return max(costs) / low if low > 0 else float("inf")
