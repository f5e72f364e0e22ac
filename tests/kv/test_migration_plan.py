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
