"""glibc malloc thresholds (memory/host_malloc.py): a step-like pattern of activation allocations on a non-main
thread (the engine thread's own arena) stops faulting its pages in again once the thresholds are set. Each side
runs in a fresh process: the settings are process-wide and cannot be undone."""
import subprocess
import sys
import textwrap

import pytest

from elastic_hf.memory.host_malloc import tune_host_malloc

PROBE = textwrap.dedent("""
    import resource, sys, threading
    import torch
    if sys.argv[1] == "tuned":
        from elastic_hf.memory.host_malloc import tune_host_malloc
        assert tune_host_malloc()
    faults = []

    def step_like():
        for _ in range(12):
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            held = []
            for mib in (3, 12, 6, 1, 9, 24, 2):       # the mix of a prefill step's activations
                tensor = torch.empty(mib << 18, dtype=torch.float32)
                tensor.fill_(1.0)                      # touch every page
                held.append(tensor)
                if len(held) > 2:
                    held.pop(0)
            held.clear()
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)

    thread = threading.Thread(target=step_like)
    thread.start()
    thread.join()
    print(sum(faults[4:]) // len(faults[4:]))          # minor faults per step once warm
""")


def _faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not tune_host_malloc(),
                    reason="glibc's mallopt only (Linux); elsewhere nothing is tuned")
def test_tuned_malloc_stops_refaulting_activation_pages():
    untuned = _faults_per_step("untuned")
    if untuned < 500:
        pytest.skip(f"this glibc does not give freed heap memory back on this pattern ({untuned} faults per step)")
    tuned = _faults_per_step("tuned")
    assert tuned <= untuned // 50, f"{tuned} minor faults per warm step with the thresholds, {untuned} without"


def test_tuning_is_idempotent():
    assert tune_host_malloc() == tune_host_malloc()
