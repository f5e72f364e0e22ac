"""Drop plans (KunServe §4.1, Fig. 6) over adjacent groups: the smallest adjacent pair merges first, every merge
frees one copy of the decoder layers until the demand is met or every group merged; refusals carry their numbers; the
stage split of a merged pipeline gives the LM head stage fewer layers."""
from __future__ import annotations

import pytest

from elastic_hf.engine.drop_plan import DropPlan, DropRefusal, plan_drop, stage_split
from elastic_hf.topology import split_layers

GiB = 1 << 30


def test_one_merge_when_one_copy_is_enough():
    plan = plan_drop([1, 1, 1, 1], layer_bytes=2 * GiB, demand_bytes=GiB)
    assert plan == DropPlan(groups=((0, 1), (2,), (3,)), new_sizes=(2, 1, 1), freed_bytes=2 * GiB,
                            demand_bytes=GiB)


def test_smallest_adjacent_pair_first_and_leftmost_on_ties():
    # [2, 1, 1, 3]: the pair (1, 1) merges (size 2), not (2, 1) (size 3); then (2, 2) beats (2, 3).
    plan = plan_drop([2, 1, 1, 3], layer_bytes=GiB, demand_bytes=2 * GiB)
    assert plan.groups == ((0, 1, 2), (3,)) and plan.new_sizes == (4, 3)
    first = plan_drop([2, 1, 1, 3], layer_bytes=GiB, demand_bytes=1)
    assert first.groups == ((0,), (1, 2), (3,)) and first.new_sizes == (2, 2, 3)
    # Fig. 6's example (sizes 1, 2, 3): 1 and 2 merge.
    assert plan_drop([1, 2, 3], GiB, GiB).new_sizes == (3, 3)
    # Equal pairs everywhere: the leftmost.
    assert plan_drop([1] * 6, GiB, 3 * GiB).new_sizes == (2, 2, 2)


@pytest.mark.parametrize("demand_copies", [0.5, 1, 2.5, 5, 7])
def test_freed_covers_the_demand_with_as_few_merges_as_needed(demand_copies):
    sizes = [1, 2, 1, 1, 3, 1, 1, 2]
    demand = int(demand_copies * GiB)
    plan = plan_drop(sizes, GiB, demand)
    assert isinstance(plan, DropPlan)
    assert plan.freed_bytes >= demand and plan.freed_bytes - GiB < demand   # one merge fewer would not do
    assert plan.freed_bytes == (len(sizes) - len(plan.new_sizes)) * GiB
    # The new groups cover the old ones in order, and their sizes add up.
    assert [i for group in plan.groups for i in group] == list(range(len(sizes)))
    assert plan.new_sizes == tuple(sum(sizes[i] for i in group) for group in plan.groups)


def test_a_demand_beyond_every_merge_merges_all_and_leaves_the_rest_queued():
    """Fig. 6 merges until the demand is met or no pair is left: a burst larger than all the replicated copies
    still gets every copy (the rest waits, §4.1), not a refusal that leaves all of it queued."""
    plan = plan_drop([1, 1, 1], layer_bytes=GiB, demand_bytes=3 * GiB)
    assert plan == DropPlan(groups=((0, 1, 2),), new_sizes=(3,), freed_bytes=2 * GiB, demand_bytes=3 * GiB)
    assert not plan.covers_demand and plan_drop([1, 1, 1], GiB, 2 * GiB).covers_demand


def test_refusals_say_why_with_the_numbers():
    refusal = plan_drop([4], GiB, 1)   # one group left: nothing to merge
    assert isinstance(refusal, DropRefusal) and "one group of 4 workers" in refusal.reason
    assert "demand is 0" in plan_drop([1, 1], GiB, 0).reason
    assert "-5 bytes" in plan_drop([1, 1], -5, GiB).reason
    with pytest.raises(ValueError, match=r"\[1, 0\]"):
        plan_drop([1, 0], GiB, GiB)


def test_stage_split_gives_the_head_stage_fewer_layers():
    assert stage_split(30, 2, layer_cost=1.0, head_cost=4.0) == (17, 13)
    assert stage_split(30, 3, layer_cost=1.0, head_cost=3.0) == (11, 11, 8)
    assert stage_split(5, 2, layer_cost=1.0, head_cost=100.0) == (4, 1)   # every stage keeps a layer
    assert stage_split(7, 1, 1.0, 5.0) == (7,)
    for layers, stages in [(5, 2), (7, 3), (30, 4), (4, 4)]:   # no head cost: topology's even split
        assert stage_split(layers, stages, 1.0, 0.0) == split_layers(layers, stages)
    with pytest.raises(ValueError, match=r"\[1, 3\].*got 4"):
        stage_split(3, 4, 1.0, 0.0)


def test_a_drop_split_holds_the_demand_before_it_balances_the_head():
    """A drop is for KV: the fastest split that holds the demand, else the one that holds the most."""
    def held(split):   # the fullest stage's tokens: a budget of 100, 2 per layer of weights, 1/10 per token-layer
        return min((100 - 2 * n) * 10 // n for n in split)

    assert (held((17, 13)), held((16, 14)), held((15, 15)), held((14, 16))) == (38, 42, 46, 42)
    assert stage_split(30, 2, 1.0, 4.0, held, need_tokens=38) == (17, 13)   # the head-balanced one holds it
    assert stage_split(30, 2, 1.0, 4.0, held, need_tokens=42) == (16, 14)   # the fastest of those that do
    assert stage_split(30, 2, 1.0, 4.0, held, need_tokens=46) == (15, 15)
    assert stage_split(30, 2, 1.0, 4.0, held, need_tokens=10 ** 6) == (15, 15)   # none does: the most
    assert stage_split(5, 2, 1.0, 100.0, lambda split: -max(split), need_tokens=0) == (3, 2)   # a tie: the faster


def test_stage_split_minimises_the_slowest_stage():
    import itertools

    for layers, stages, head in [(9, 3, 2.5), (12, 2, 0.7), (10, 4, 6.0)]:
        best = min(max([n for n in split[:-1]] + [split[-1] + head])
                   for split in itertools.product(range(1, layers + 1), repeat=stages) if sum(split) == layers)
        split = stage_split(layers, stages, 1.0, head)
        assert sum(split) == layers and min(split) >= 1
        assert max(list(split[:-1]) + [split[-1] + head]) == best
