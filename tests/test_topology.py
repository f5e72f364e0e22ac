"""Topologies: candidate layouts of a deployment and the process groups they need (torch-free)."""
import pytest

from elastic_hf.topology import Topology, candidate_topologies, group_rank_sets, parse_topology


def test_candidate_topologies_and_groups():
    assert [t.sizes for t in candidate_topologies(2, (1, 2))] == [(1, 1), (2,)]
    four = {t.sizes for t in candidate_topologies(4, (1, 2, 4))}
    assert {(1, 1, 1, 1), (2, 2), (4,), (2, 1, 1)} <= four
    assert group_rank_sets(candidate_topologies(4, (1, 2, 4))) == [(0, 1), (1, 2), (2, 3), (0, 1, 2, 3)]
    t = parse_topology("2,1,1")
    assert t.instances() == [(0, 1), (2,), (3,)] and t.role(3) == (2, 1, 0) and str(t) == "[2,1,1]"
    with pytest.raises(ValueError):
        Topology(())
