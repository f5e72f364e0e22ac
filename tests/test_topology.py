"""Topologies: candidate layouts of a deployment (TP x PP), their syntax, layer splits and the process groups they
need (torch-free)."""
import pickle

import pytest

from elastic_hf.config import EngineConfig
from elastic_hf.topology import InstanceShape, Topology, candidate_topologies, group_rank_sets, parse_topology


def test_candidate_topologies_and_groups():
    assert [t.sizes for t in candidate_topologies(2, (1, 2))] == [(1, 1), (2,)]
    four = {t.sizes for t in candidate_topologies(4, (1, 2, 4))}
    assert {(1, 1, 1, 1), (2, 2), (4,), (2, 1, 1)} <= four
    assert group_rank_sets(candidate_topologies(4, (1, 2, 4))) == [(0, 1), (1, 2), (2, 3), (0, 1, 2, 3)]
    t = parse_topology("2,1,1")
    assert t.instances() == [(0, 1), (2,), (3,)] and t.role(3)[:3] == (2, 1, 0) and str(t) == "[2,1,1]"
    with pytest.raises(ValueError):
        Topology(())


def test_pipelined_candidates_on_two_and_four_workers():
    two = [str(t) for t in candidate_topologies(2, (1, 2), max_pp=2)]
    assert two == ["[1,1]", "[2]", "[1x2]"]
    four = {str(t) for t in candidate_topologies(4, (1, 2, 4), max_pp=4)}
    assert {"[2,2]", "[2x2]", "[1x4]", "[2,1x2]", "[1x2,2]", "[1x2,1x2]", "[4]", "[1,1,1,1]"} <= four
    # Stage groups of 2x2 are (0,1) and (2,3); a 1x4 pipeline needs no group (point-to-point on global ranks).
    assert (0, 1) in group_rank_sets([parse_topology("2x2")]) and group_rank_sets([parse_topology("1x4")]) == []


def test_syntax_roles_and_layer_splits():
    t = parse_topology("[1x2:16/14,1]")
    assert t.sizes == (InstanceShape(1, 2, (16, 14)), 1) and str(t) == "[1x2:16/14,1]" and t.num_workers == 3
    assert not t.is_tensor_only and parse_topology([2, 1]).is_tensor_only
    assert parse_topology(["1x2"]) == parse_topology("1x2") == Topology((InstanceShape(1, 2),))
    assert parse_topology("2x1") == parse_topology("2")              # one stage is plain TP
    assert t.layer_range(0, 30) == (0, 16) and t.layer_range(1, 30) == (16, 30) and t.layer_range(2, 30) == (0, 30)
    role = parse_topology("2x2").role(3)
    assert (role.instance, role.tp, role.rank, role.pp, role.stage, role.stage_workers) == (0, 2, 1, 2, 1, (2, 3))
    assert role.is_last_stage and not role.is_first_stage
    # An even split gives the first stages the remainder: the LM head stage holds fewer layers.
    assert parse_topology("1x2").layer_range(1, 5) == (3, 5)
    assert parse_topology("1x4").shapes[0].stage_bounds(30) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert t.without_splits() == parse_topology("1x2,1")
    assert pickle.loads(pickle.dumps(t)) == t


@pytest.mark.parametrize("text,message", [("1x2:30/0", "no empty stage"), ("1x2:10/10/10", "2 counts"),
                                          ("2y2", "TPxPP"), ("0x2", "tp >= 1"), ("", "at least one")])
def test_bad_topologies_name_what_is_allowed(text, message):
    with pytest.raises(ValueError, match=message):
        parse_topology(text)


def test_split_must_cover_the_model_and_config_normalises():
    with pytest.raises(ValueError, match="covers 20 layers; the model has 30"):
        parse_topology("1x2:10/10").check_layers(30)
    config = EngineConfig(num_workers=3, topology="1x2,1")
    assert config.topology == (InstanceShape(1, 2), 1)
    with pytest.raises(ValueError, match="covers 4 workers"):
        EngineConfig(num_workers=2, topology="1x4")
