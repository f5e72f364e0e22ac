"""The TP routing policy (Gyges Alg. 1-2), torch-free: who can hold a request, long requests prefer merged
instances, merges are x2 of equal adjacent degrees, merged instances split back when drained."""
import pytest

from elastic_hf.config import EngineConfig
from elastic_hf.engine.routing import Admission, InstanceLoad, TPPolicy


def _loads(*specs):
    # requests: one per 10 used blocks; split capacity: as if the halves held 40 % of the merged instance
    return [InstanceLoad(i, tp, total, used, used // 10, num_long, int(0.4 * total) if tp > 1 else 0)
            for i, (tp, total, used, num_long) in enumerate(specs)]


def test_elastic_router_prefers_tp1_for_short_and_merged_for_long():
    policy = TPPolicy(EngineConfig(tp_policy="elastic", router="elastic"), (1, 2, 4))
    loads = _loads((2, 300, 100, 1), (1, 50, 10, 0), (1, 50, 40, 0))
    assert policy.route(loads, 5, is_long=False) == (1, True)      # 1 request vs (10 + 1) / 2 and 4
    assert policy.route(_loads((2, 300, 20, 0), (1, 50, 40, 0)), 5, is_long=False) == (0, True)  # 1.5 < 4
    assert policy.route(loads, 80, is_long=True) == (0, True)
    assert policy.route(loads, 250, is_long=True) == (0, False)  # nothing holds it now


def test_baselines_pick_first_and_check_after():
    rr = TPPolicy(EngineConfig(tp_policy="elastic", router="round_robin"))
    loads = _loads((1, 50, 0, 0), (1, 50, 0, 0))
    assert [rr.route(loads, 60, True) for _ in range(3)] == [(0, False), (1, False), (0, False)]
    llf = TPPolicy(EngineConfig(tp_policy="elastic", router="least_load"))
    assert llf.route(_loads((1, 50, 30, 0), (1, 50, 10, 0)), 5, False) == (1, True)


def test_scale_up_merges_least_loaded_equal_pair():
    policy = TPPolicy(EngineConfig(tp_policy="elastic", router="elastic"), (1, 2, 4))
    loads = _loads((1, 50, 40, 0), (1, 50, 30, 0), (1, 50, 0, 0), (1, 50, 5, 0))
    assert policy.scale_up_target((1, 1, 1, 1), loads) == (1, 1, 2)
    assert policy.scale_up_target((1, 1, 1, 1), loads, anchor=0) == (2, 1, 1)
    assert policy.scale_up_target((2, 2), _loads((2, 90, 0, 0), (2, 90, 0, 0))) == (4,)
    assert policy.scale_up_target((2, 1, 1), _loads((2, 90, 0, 0), (1, 50, 0, 0), (1, 50, 0, 0))) == (2, 2)
    assert TPPolicy(EngineConfig(tp_policy="static")).scale_up_target((1, 1), _loads((1, 5, 0, 0), (1, 5, 0, 0))) is None


def test_scale_down_waits_for_long_requests_and_low_load():
    policy = TPPolicy(EngineConfig(tp_policy="elastic", router="elastic"), (1, 2))
    assert policy.scale_down_target((2,), _loads((2, 100, 10, 1))) is None   # a long request is still there
    assert policy.scale_down_target((2,), _loads((2, 100, 25, 0))) is None   # above 50 % of the halves' 40
    assert policy.scale_down_target((2,), _loads((2, 100, 10, 0))) == (1, 1)


def test_admission_merges_first_when_nothing_can_ever_hold_the_request():
    policy = TPPolicy(EngineConfig(tp_policy="elastic", router="elastic"), (1, 2))
    loads = _loads((1, 50, 0, 0), (1, 50, 10, 0))
    assert policy.admit(loads, (1, 1), 10, is_long=False) == Admission(0)
    assert policy.admit(loads, (1, 1), 80, is_long=True) == Admission(None, (2,))
    # the merge was refused: queue it where it could fit some day, here nowhere -> the router's pick
    assert policy.admit(loads, (1, 1), 80, is_long=True, merge_failed=True) == Admission(0)
    static = TPPolicy(EngineConfig(tp_policy="static"), (1, 2))
    assert static.admit(loads, (1, 1), 80, is_long=True) == Admission(0)


def test_config_is_validated():
    with pytest.raises(ValueError, match="tp_policy"):
        EngineConfig(tp_policy="dynamic")
    with pytest.raises(ValueError, match="router"):
        EngineConfig(tp_policy="elastic", router="random")


def test_cache_aware_routing_follows_the_cached_prefix_within_the_load_slack():
    """A request goes where its prefix is cached unless that instance is more than CACHE_AFFINITY_SLACK busier."""
    from dataclasses import replace

    from elastic_hf.engine.routing import CACHE_AFFINITY_SLACK

    for router in ("least_load", "elastic"):
        policy = TPPolicy(EngineConfig(router=router))
        loads = _loads((1, 100, 10, 0), (1, 100, 20, 0), (1, 100, 60, 0))
        assert policy.route(loads, 5, False) == (0, True)                     # nothing cached: the usual pick
        warm = [replace(loads[1], num_cached_blocks=6) if x.index == 1 else x for x in loads]
        assert policy.route(warm, 5, False) == (1, True)                      # 10 % busier holds the history
        hot = [replace(loads[2], num_cached_blocks=9) if x.index == 2 else x for x in loads]
        assert 0.6 - 0.1 > CACHE_AFFINITY_SLACK and policy.route(hot, 5, False) == (0, True)   # too busy
