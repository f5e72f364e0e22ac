"""The morphing controller's decisions on synthetic serving stats (torch-free): persistence windows, hysteresis,
LIS order, modes, and no oscillation under a load hovering at the threshold."""
from __future__ import annotations

import random

import pytest

from elastic_hf.morph.controller import ControllerConfig, MorphController
from elastic_hf.morph.monitor import ServingMonitor, ServingSample

NUM_LAYERS = 8
GAIN = 10  # KV blocks a layer gives when it goes to W4


def sample(t, used, total, waiting=0, delay=0.0, blocked=False):
    return ServingSample(t, used, total, waiting, 1, delay, blocked)


def make(order=None, **overrides):
    config = ControllerConfig.for_mode("default", **{"restore_hold_s": 0.0, **overrides})
    return MorphController(config, order or list(range(NUM_LAYERS)), {"w8": GAIN // 2, "w4": GAIN})


def test_morph_needs_persistent_pressure_and_follows_the_order():
    order = [5, 2, 7, 0, 1, 3, 4, 6]
    c = make(order=order, persistence_steps=4, window_steps=1, layers_per_step=2)
    precisions = ["fp"] * NUM_LAYERS
    # 3 steps over the threshold, then one under: the window restarts
    for t in range(3):
        assert c.decide(sample(t, 90, 100), precisions, busy=False) is None
    assert c.decide(sample(3, 50, 100), precisions, busy=False) is None
    decisions = [c.decide(sample(4 + t, 90, 100), precisions, busy=False) for t in range(4)]
    assert decisions[:3] == [None, None, None]
    assert decisions[3].kind == "morph" and decisions[3].layers == [5, 2] and decisions[3].precision == "w4"


def test_queue_delay_counts_only_when_the_queue_waits_for_kv_blocks():
    c = make(persistence_steps=2, window_steps=1)
    precisions = ["fp"] * NUM_LAYERS
    # long queue delay on a step-budget-bound CPU, plenty of blocks: quantizing cannot help
    for t in range(10):
        assert c.decide(sample(t, 10, 100, waiting=5, delay=0.5, blocked=False), precisions, False) is None
    c.decide(sample(10, 10, 100, waiting=5, delay=0.5, blocked=True), precisions, False)
    decision = c.decide(sample(11, 10, 100, waiting=5, delay=0.5, blocked=True), precisions, False)
    assert decision is not None and decision.kind == "morph" and "queue delay" in decision.reason


def test_busy_swaps_freeze_the_windows():
    c = make(persistence_steps=2, window_steps=1)
    precisions = ["fp"] * NUM_LAYERS
    for t in range(10):
        assert c.decide(sample(t, 95, 100), precisions, busy=True) is None
    assert c.decide(sample(10, 95, 100), precisions, False) is None
    assert c.decide(sample(11, 95, 100), precisions, False).kind == "morph"


def test_restore_in_reverse_order_only_when_calm_long_enough():
    order = [3, 1, 2, 0, 4, 5, 6, 7]
    c = make(order=order, restore_persistence_steps=5, window_steps=1)
    precisions = ["w4", "w4", "fp", "w4", "fp", "fp", "fp", "fp"]   # order[0..1] = 3, 1 and layer 0 are W4
    total = 100 + 3 * GAIN
    # projected use after giving back one layer's blocks: 65 / 120 = 0.54 < 0.6, but a queue exists
    for t in range(10):
        assert c.decide(sample(t, 65, total, waiting=1), precisions, False) is None
    # 75 / 120 = 0.625: not calm enough
    for t in range(10):
        assert c.decide(sample(10 + t, 75, total), precisions, False) is None
    decisions = [c.decide(sample(20 + t, 40, total), precisions, False) for t in range(5)]
    assert decisions[:4] == [None] * 4
    assert decisions[4].kind == "restore" and decisions[4].layers == [0] and decisions[4].precision == "fp"


def test_restore_waits_for_the_hold_time():
    c = make(restore_persistence_steps=2, window_steps=1, restore_hold_s=5.0)
    precisions = ["w4"] + ["fp"] * (NUM_LAYERS - 1)
    decisions = [c.decide(sample(t * 0.5, 0, 110), precisions, False) for t in range(12)]  # 0 .. 5.5 s
    assert [d is not None for d in decisions].index(True) == 10    # first at t = 5.0 s


def test_no_oscillation_under_a_load_hovering_at_the_threshold():
    """Closed loop: demand hovers around 85 % of the fp cache; each morph adds blocks. The controller morphs a
    little at most and never restores while the load stays (hysteresis + persistence)."""
    rng = random.Random(0)
    c = make(persistence_steps=4, window_steps=4, layers_per_step=1, restore_persistence_steps=8)
    precisions = ["fp"] * NUM_LAYERS
    fp_blocks = 100
    kinds = []
    for t in range(2000):
        total = fp_blocks + GAIN * sum(p == "w4" for p in precisions)
        used = min(total, int(fp_blocks * (0.85 + rng.uniform(-0.04, 0.04))))
        decision = c.decide(sample(t * 0.05, used, total), precisions, False)
        if decision is not None:
            kinds.append(decision.kind)
            for layer in decision.layers:
                precisions[layer] = decision.precision
    assert "restore" not in kinds, kinds
    assert len(kinds) <= 2, kinds


def test_no_flapping_under_alternating_bursts():
    """Pressure and calm alternating every few steps (shorter than the windows) cause no swaps at all."""
    c = make(persistence_steps=4, window_steps=2, restore_persistence_steps=8)
    precisions = ["w4"] + ["fp"] * (NUM_LAYERS - 1)
    for t in range(400):
        used = 95 if (t // 3) % 2 == 0 else 20
        assert c.decide(sample(t * 0.05, used, 110), precisions, False) is None


def test_max_layers_and_modes():
    c = make(persistence_steps=1, window_steps=1, layers_per_step=4, max_layers=3)
    precisions = ["fp"] * NUM_LAYERS
    assert c.decide(sample(0, 99, 100), precisions, False).layers == [0, 1, 2]
    accuracy = ControllerConfig.for_mode("accuracy")
    performance = ControllerConfig.for_mode("performance")
    default = ControllerConfig.for_mode("default")
    assert accuracy.precision == "w8" and default.precision == performance.precision == "w4"
    assert accuracy.kv_use_threshold > default.kv_use_threshold > performance.kv_use_threshold
    assert (default.kv_use_threshold, default.queue_delay_threshold_s) == (0.85, 0.1)
    assert performance.layers_per_step > default.layers_per_step > accuracy.layers_per_step


@pytest.mark.parametrize("kwargs, match", [
    (dict(kv_use_threshold=1.5), "kv_use_threshold=1.5 must be in"),
    (dict(restore_kv_use=0.9), "the gap is the hysteresis"),
    (dict(persistence_steps=0), "persistence_steps=0 must be >= 1"),
    (dict(precision="w3"), "precision='w3'"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ControllerConfig(**kwargs)
    with pytest.raises(ValueError, match="morph mode 'fast' is unknown"):
        ControllerConfig.for_mode("fast")
    with pytest.raises(ValueError, match="permutation"):
        MorphController(ControllerConfig(), [0, 0, 1], {})


def test_monitor_smooths_over_its_window():
    m = ServingMonitor(window=2)
    m.observe(ServingSample(0, 10, 100, 0, 1, ttft_s=[0.2]))
    view = m.observe(ServingSample(1, 30, 100, 2, 1, 0.4, True, ttft_s=[0.4], tpot_s=[0.05]))
    assert view.kv_use == pytest.approx(0.2) and view.queue_len == 1 and view.queue_delay_s == pytest.approx(0.2)
    assert view.ttft_s == pytest.approx(0.3) and view.tpot_s == pytest.approx(0.05)
    with pytest.raises(ValueError, match="kv_blocks_used=5 must be in"):
        ServingSample(0, 5, 4, 0, 0)
