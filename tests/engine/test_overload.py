"""The overload arbiter (torch-free): which response acts, its hold and restore windows, no oscillation under a load
hovering at the thresholds; and the scheduler's exchanging state (a parameter drop's parked sequences)."""
import pytest

from elastic_hf.config import EngineConfig, OverloadConfig
from elastic_hf.engine.overload import RETRY_BACKOFF_STEPS, SLOPE_WINDOW_STEPS, OverloadArbiter, OverloadSnapshot
from elastic_hf.engine.scheduler import Scheduler
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.sequence import Sequence, SeqStatus
from elastic_hf.kv.kv_manager import KVManager

BASE = 1000


def snap(demand, capacity=BASE, gain=0, morphed=False):
    return OverloadSnapshot(demand, capacity, BASE, gain, morphed)


def drive(arbiter, demands, capacity_when_active=2 * BASE):
    """Feed demands; execute every decision successfully; return the actions in order."""
    actions = []
    for demand in demands:
        capacity = capacity_when_active if arbiter.active in ("drop", "tp-merge") else BASE
        decision = arbiter.decide(snap(demand, capacity))
        if decision is not None:
            actions.append(decision.action)
            arbiter.done(decision.action, True)
    return actions


def test_drop_after_the_hold_window_and_restore_below_half_of_the_undropped_capacity():
    arbiter = OverloadArbiter(OverloadConfig("drop", hold_steps=3, restore_hold_steps=4, cooldown_steps=5), False,
                              True)
    assert drive(arbiter, [1200, 1200]) == []            # overloaded, but not for long enough
    assert drive(arbiter, [1200]) == ["drop"] and arbiter.active == "drop"
    assert drive(arbiter, [600] * 10) == []               # 60 % of the undropped capacity: stays dropped
    assert drive(arbiter, [400] * 3) == []
    assert drive(arbiter, [400]) == ["restore"] and arbiter.active is None
    assert drive(arbiter, [1500] * 5) == []               # cooldown: nothing starts right after a restore
    assert drive(arbiter, [1500] * 3) == ["drop"]


def test_a_load_hovering_at_the_thresholds_does_not_oscillate():
    arbiter = OverloadArbiter(OverloadConfig("drop", hold_steps=3, restore_hold_steps=32, cooldown_steps=64), False,
                              True)
    # Around the trigger (demand / capacity crosses 1 every other step) and, once dropped, around 50 % of the
    # undropped capacity: one drop, no restore.
    hovering = [1050, 950] * 50 + [1200] * 3 + [520, 480] * 200
    assert drive(arbiter, hovering) == ["drop"]
    # A load that really stays low restores once, and then a hovering load does not drop again within the cooldown.
    assert drive(arbiter, [300] * 32 + [1050, 1100, 1200] * 20) == ["restore"]


def test_a_demand_growing_towards_the_capacity_drops_before_it_arrives():
    """Past predict_floor of the trigger, the demand lead_steps ahead at its growth over the last SLOPE_WINDOW_STEPS
    steps counts: a ramp of 3 tokens a step from 800 projects past the capacity 64 steps ahead, so the drop comes
    while the demand is still below it, with the projected deficit as its need; the same ramp with lead_steps=0,
    a flat demand below the capacity, and a steep ramp below the floor do not drop early."""
    ramp = [800 + 3 * i for i in range(100)]               # 800 .. 1097: past 1000 from step 67
    early = OverloadArbiter(OverloadConfig("drop", hold_steps=2, lead_steps=64), False, True)
    i, decision = next((i, d) for i, d in ((i, early.decide(snap(d))) for i, d in enumerate(ramp)) if d is not None)
    assert ramp[i] < BASE and i == SLOPE_WINDOW_STEPS + 1      # once the window has filled (and held 2 steps)
    assert decision.action == "drop" and decision.need_tokens == ramp[i] + 3 * 64 - BASE
    assert early.projected_tokens == ramp[i] + 3 * 64
    late = OverloadArbiter(OverloadConfig("drop", hold_steps=2, lead_steps=0), False, True)
    assert next(i for i, d in enumerate(ramp) if late.decide(snap(d)) is not None) == 68   # 1001, 1004: 2 steps
    flat = OverloadArbiter(OverloadConfig("drop", hold_steps=2, lead_steps=64), False, True)
    assert drive(flat, [990, 960, 995, 970] * 40) == []
    low = OverloadArbiter(OverloadConfig("drop", hold_steps=2, lead_steps=64, predict_floor=0.8), False, True)
    assert drive(low, [100 + 20 * i for i in range(35)]) == []   # 100 .. 780: steep, but below 800


def test_auto_morphs_a_small_deficit_and_drops_a_large_one():
    auto = OverloadConfig("auto", hold_steps=1)
    small = OverloadArbiter(auto, has_morph=True, can_reshape=True)
    decision = small.decide(snap(1100, gain=300))
    assert decision.action == "morph"
    small.done("morph", True)
    assert small.morph_controllers_on
    assert small.decide(snap(1500, gain=0, morphed=True)) is None      # one response at a time: no drop meanwhile
    assert small.decide(snap(800, morphed=False)).action == "morph-done"
    small.done("morph-done", True)
    assert not small.morph_controllers_on
    large = OverloadArbiter(auto, has_morph=True, can_reshape=True)
    assert large.decide(snap(2000, gain=300)).action == "drop"
    assert not large.morph_controllers_on


def test_a_refused_response_backs_off_and_modes_without_reshapes_never_decide():
    arbiter = OverloadArbiter(OverloadConfig("tp-merge", hold_steps=1), False, True)
    assert arbiter.decide(snap(1500)).action == "tp-merge"
    arbiter.done("tp-merge", False)
    assert drive(arbiter, [1500] * RETRY_BACKOFF_STEPS) == []
    assert drive(arbiter, [1500]) == ["tp-merge"]
    for mode in ("off", "morph"):
        quiet = OverloadArbiter(OverloadConfig(mode, hold_steps=0), True, True)
        assert drive(quiet, [5000] * 10) == []
    assert OverloadArbiter(OverloadConfig("morph"), True, True).morph_controllers_on


def test_overload_config_errors_name_the_values():
    with pytest.raises(ValueError, match="allowed: off, morph, tp-merge, drop, auto"):
        OverloadConfig("spill")
    with pytest.raises(ValueError, match="restore_below=1.5"):
        OverloadConfig("drop", restore_below=1.5)
    with pytest.raises(ValueError, match="predict_floor must be in \\(0, 1\\], got 1.5"):
        OverloadConfig("drop", predict_floor=1.5)
    with pytest.raises(ValueError, match="lead_steps must be >= 0, got -1"):
        OverloadConfig("drop", lead_steps=-1)
    with pytest.raises(ValueError, match="exchange_cpu_share_queued must be in \\(0, 1\\], got 0"):
        OverloadConfig("drop", exchange_cpu_share_queued=0)
    with pytest.raises(ValueError, match="exchange_cpu_share_queued must be in \\(0, 1\\], got '0.5'"):
        OverloadConfig("drop", exchange_cpu_share_queued="0.5")
    assert OverloadConfig("drop", exchange_cpu_share_queued=1.0).exchange_cpu_share_queued == 1.0
    with pytest.raises(ValueError, match="num_workers is 1"):
        EngineConfig(overload="drop")
    with pytest.raises(ValueError, match="needs a morph mode with a controller"):
        EngineConfig(num_workers=2, overload="morph")
    assert EngineConfig(num_workers=2, overload={"mode": "auto", "hold_steps": 5}).overload.hold_steps == 5


def _seq(seq_id, num_tokens=20):
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(num_tokens)), num_tokens, SamplingParams(max_tokens=4), 0.0)


def _parked(seq_ids):
    """A scheduler over 8 blocks with the given sequences prefilled (2 blocks each) and parked for an exchange."""
    scheduler = Scheduler(EngineConfig(block_size=16), KVManager(8, 16))
    parked = [_seq(i) for i in seq_ids]
    for seq in parked:
        seq.block_ids = scheduler.kv.allocate(2)
        seq.num_computed_tokens = 20
    scheduler.park_exchanging(parked)
    return scheduler, parked


def test_exchanging_sequences_hold_their_blocks_and_wait():
    scheduler, parked = _parked([0, 1])
    scheduler.add(_seq(2))
    scheduled = scheduler.schedule()
    assert [s.seq.seq_id for s in scheduled] == [2] and scheduler.has_work()   # the queue runs meanwhile
    # Aborting a parked sequence does not free its blocks while the exchange may still write them.
    scheduler.finish(parked[1], "abort")
    assert scheduler.kv.num_free == 8 - 4 - 2
    assert scheduler.release_exchanging() == 1
    assert parked[0].status is SeqStatus.RUNNING and scheduler.kv.num_free == 8 - 2 - 2
    assert [s.seq_id for s in scheduler.running] == [0, 2]   # admission order


def test_a_lost_exchange_recomputes_the_parked_sequences():
    scheduler, parked = _parked([3, 1])
    assert scheduler.drop_exchanging() == 2
    assert scheduler.kv.num_free == 8 and [s.seq_id for s in scheduler.waiting] == [1, 3]
    assert all(s.num_computed_tokens == 0 and s.status is SeqStatus.WAITING for s in parked)
