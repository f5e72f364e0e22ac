import threading

import pytest

from elastic_hf.memory import MemoryBudget, MemoryBudgetExceeded, parse_memory_budget

MiB = 1 << 20
GiB = 1 << 30


def test_charge_release_and_report():
    budget = MemoryBudget(64 * MiB)
    budget.charge("weights", 40 * MiB)
    budget.charge("kv", 10 * MiB)
    assert budget.used_bytes() == 50 * MiB
    assert budget.used_bytes("kv") == 10 * MiB
    assert budget.used_bytes("nobody") == 0
    assert budget.free_bytes == 14 * MiB
    budget.release("weights", 8 * MiB)
    assert budget.report() == {"weights": 32 * MiB, "kv": 10 * MiB, "total": 64 * MiB, "used": 42 * MiB,
                               "free": 22 * MiB}


def test_exceeding_raises_with_numbers_and_changes_nothing():
    budget = MemoryBudget(64 * MiB)
    budget.charge("weights", int(50.1 * MiB))
    budget.charge("kv", int(10.4 * MiB))
    with pytest.raises(MemoryBudgetExceeded) as info:
        budget.charge("kv", 12 * MiB)
    message = str(info.value)
    assert message.startswith("memory budget exceeded: need 12.0 MiB, 3.5 MiB free of 64.0 MiB "
                              "(weights 50.1 MiB, kv 10.4 MiB)")
    assert isinstance(info.value, MemoryError)
    assert budget.used_bytes() == int(50.1 * MiB) + int(10.4 * MiB)


def test_exact_fit_and_over_release():
    budget = MemoryBudget(4 * MiB)
    budget.charge("kv", 4 * MiB)
    assert budget.free_bytes == 0
    with pytest.raises(ValueError, match="release of 5242880 bytes by 'kv' exceeds the 4194304 bytes"):
        budget.release("kv", 5 * MiB)
    with pytest.raises(ValueError):
        budget.charge("kv", -1)
    with pytest.raises(ValueError):
        MemoryBudget(0)


def test_concurrent_charges_never_overshoot():
    budget = MemoryBudget(1000)
    failures = []

    def worker():
        for _ in range(200):
            try:
                budget.charge("kv", 3)
            except MemoryBudgetExceeded:
                failures.append(1)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert budget.used_bytes() == 999 and len(failures) == 800 - 333


@pytest.mark.parametrize("value, expected", [
    (1234, 1234),
    ("1234", 1234),
    ("512MiB", 512 * MiB),
    ("512 mib", 512 * MiB),
    ("2GB", 2 * 10**9),
    ("1.5GiB", 3 * GiB // 2),
    ("64M", 64 * MiB),
    ("0.8", int(0.8 * 8 * GiB)),
    (0.5, 4 * GiB),
    ("50%", 4 * GiB),
    ("1.0", 8 * GiB),
    (float(GiB), GiB),
])
def test_parse_memory_budget(value, expected):
    assert parse_memory_budget(value, 8 * GiB) == expected


@pytest.mark.parametrize("value, match", [
    ("lots", "cannot parse memory budget 'lots'"),
    ("12 parsecs", "cannot parse"),
    ("", "cannot parse"),
    (0, "must be > 0"),
    (-5, "must be > 0"),
    ("0MiB", "must be > 0"),
    ("0.0", r"not in \(0, 1\]"),
    ("1.5", r"not in \(0, 1\]"),
    ("150%", r"must be in \(0, 1\]"),
    (2.5, "neither a fraction"),
    (True, "memory budget must be"),
    ("16GiB", "exceeds the device's 8192.0 MiB"),
])
def test_parse_memory_budget_rejects(value, match):
    with pytest.raises(ValueError, match=match):
        parse_memory_budget(value, 8 * GiB)


def test_fraction_needs_device_size():
    with pytest.raises(ValueError, match="device size is unknown"):
        parse_memory_budget("0.5", None)
    assert parse_memory_budget("1GiB", None) == GiB
