"""The 2-D KV migration plan (torch-free): every head of every moved block goes exactly once to the rank that owns
it in the new instance."""
import pytest

from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan
from elastic_hf.layers.shard_layout import split_units
from elastic_hf.topology import Topology


@pytest.mark.parametrize("old,new,heads", [((1, 1), (2,), 3), ((2,), (1, 1), 3), ((4,), (2, 1, 1), 4),
                                           ((1, 1, 1, 1), (4,), 4)])
def test_migration_plan_covers_every_head_once(old, new, heads):
    old_t, new_t = Topology(old), Topology(new)
    moves = [BlockMove(0, 0, (5, 6), (0, 1))]
    plan = build_migration_plan(moves, old_t, new_t, heads)
    for block in (0, 1):
        covered = sorted(h for t in plan if t.dst_block == block for h in range(t.head_start, t.head_end))
        assert covered == list(range(heads))
    for t in plan:  # each head range goes to the rank that owns it in the new instance
        role = new_t.role(t.dst_worker)
        lo, hi = split_units(heads, role[1])[role[2]]
        assert lo <= t.head_start < t.head_end <= hi
