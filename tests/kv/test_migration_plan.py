"""The 2-D KV migration plan (torch-free, ReMP Alg. 1 and §3.5.5): every (layer, head) of every moved block goes
exactly once to the rank that owns it in the new topology, across TP and PP layouts; the checker catches plans
that break the invariants."""
import dataclasses

import pytest

from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan, check_plan, plan_payload_bytes
from elastic_hf.topology import parse_topology

LAYERS = 5


@pytest.mark.parametrize("old,new,heads", [
    ("1,1", "2", 3), ("2", "1,1", 3), ("4", "2,1,1", 4), ("1,1,1,1", "4", 4),
    ("1,1", "1x2", 3), ("1x2", "2", 3), ("2", "1x2:1/4", 3), ("1x2:4/1", "1x2:2/3", 3),
    ("2,2", "2x2", 4), ("2x2", "1x4", 4), ("1x4", "2,2", 4), ("2x2", "2,1x2", 4)])
def test_migration_plan_covers_every_layer_and_head_once(old, new, heads):
    old_t, new_t = parse_topology(old), parse_topology(new)
    moves = [BlockMove(0, 0, (5, 6), (0, 1))]
    plan = build_migration_plan(moves, old_t, new_t, heads, LAYERS)
    check_plan(moves, plan, old_t, new_t, heads, LAYERS)
    for block in (0, 1):
        cells = sorted((layer, h) for t in plan if t.dst_block == block
                       for layer in range(t.layer_start, t.layer_end) for h in range(t.head_start, t.head_end))
        # Head ranges of the ranks are disjoint and stages split the layers: every cell exactly once.
        assert cells == [(layer, h) for layer in range(LAYERS) for h in range(heads)]
    for t in plan:  # each piece goes to the worker that owns it in the new instance
        lo, hi = new_t.layer_range(t.dst_worker, LAYERS)
        assert lo <= t.layer_start < t.layer_end <= hi
    sizes = plan_payload_bytes(plan, block_size=16, head_dim=8, itemsize=4)
    assert sizes["sent"] + sizes["local"] == 2 * LAYERS * heads * 2 * 16 * 8 * 4


def test_checker_catches_a_gap_an_overlap_and_a_wrong_block():
    old_t, new_t = parse_topology("1,1"), parse_topology("1x2")
    moves = [BlockMove(0, 0, (5,), (0,))]
    plan = build_migration_plan(moves, old_t, new_t, 3, LAYERS)
    with pytest.raises(ValueError, match="cells"):
        check_plan(moves, plan[1:], old_t, new_t, 3, LAYERS)                     # a stage misses its layers
    with pytest.raises(ValueError, match="twice"):
        check_plan(moves, plan + plan[:1], old_t, new_t, 3, LAYERS)
    wrong = [dataclasses.replace(plan[0], dst_block=7)] + plan[1:]
    with pytest.raises(ValueError):
        check_plan(moves, wrong, old_t, new_t, 3, LAYERS)
    outside = [dataclasses.replace(plan[0], layer_end=LAYERS)] + plan[1:]
    with pytest.raises(ValueError, match="holds layers"):
        check_plan(moves, outside, old_t, new_t, 3, LAYERS)


def test_a_block_shared_by_two_sequences_is_copied_for_each():
    """A cached prefix block two sequences hold (prefix caching, n > 1) moves once per sequence into that
    sequence's own new block; a transfer into a block no move names is still caught."""
    old_t, new_t = parse_topology("1,1"), parse_topology("1x2")
    moves = [BlockMove(0, 0, (3, 4), (0, 1)), BlockMove(0, 0, (3, 5), (2, 3))]   # block 3 shared
    plan = build_migration_plan(moves, old_t, new_t, 3, LAYERS)
    check_plan(moves, plan, old_t, new_t, 3, LAYERS)
    assert {t.dst_block for t in plan if t.src_block == 3} == {0, 2}
    wrong = [dataclasses.replace(t, dst_block=1) if t.src_block == 3 else t for t in plan]
    with pytest.raises(ValueError, match="not where its move puts it|twice|cells"):
        check_plan(moves, wrong, old_t, new_t, 3, LAYERS)
