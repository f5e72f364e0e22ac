"""The KV exchange's thread on a worker (parallel/worker_exchange.py): it moves layers beside the steps, held to its
CPU share of a core while a step runs, at full speed otherwise or once the control plane waits for the end, and a
failed transfer is reported through progress(). The transfer itself is replaced by one that spends a fixed time per
layer (the real one, over gloo between processes, runs in test_param_drop.py)."""
import time
from types import SimpleNamespace

import pytest

from elastic_hf.kv.migration_plan import KVTransfer
from elastic_hf.parallel import worker_exchange
from elastic_hf.parallel.worker_exchange import KVExchangeParticipant

LAYERS, LAYER_S = 6, 0.02


def _fake_migrate(fail_at=None, during_layer=None, waits=False):
    def migrate(transfers, me, src, src_head, dst, dst_head, *, group, after_layer):
        stats = {"sent_bytes": 0, "received_bytes": 0, "local_bytes": 0}
        for layer in range(LAYERS):
            if layer == fail_at:
                raise RuntimeError("connection closed by peer")
            if during_layer is not None:
                during_layer(layer)
            if waits:   # waiting for a peer: wall time, no CPU time
                time.sleep(LAYER_S)
            else:       # the transfer's work for one layer: LAYER_S of this thread's CPU time, which the cap counts,
                work_until = time.thread_time() + LAYER_S   # however long other processes keep the core from it
                while time.thread_time() < work_until:
                    pass
            stats["sent_bytes"] += 1000
            after_layer(stats)
        return stats
    return migrate


def _participant(monkeypatch, in_step: bool, fail_at=None, during_layer=None, waits=False):
    worker = SimpleNamespace(me=0, steps_started=0, in_step=in_step, groups=SimpleNamespace(exchange=None))
    worker.closed = []
    monkeypatch.setattr(worker_exchange, "migrate_kv",
                        _fake_migrate(fail_at, during_layer and (lambda layer: during_layer(worker, layer)), waits))
    old_pool = SimpleNamespace(arena=SimpleNamespace(close=lambda: worker.closed.append("old pool")))
    part = KVExchangeParticipant(worker)
    part.begin([KVTransfer(0, 1, 0, 0, 0, 1, 0, 1)], old_pool, 0, object(), 0)
    return part, worker


def _until_done(part: KVExchangeParticipant, limit_s: float = 30.0) -> dict:
    deadline = time.perf_counter() + limit_s
    while time.perf_counter() < deadline:
        report = part.progress()
        if report["done"]:
            return report
        time.sleep(0.005)
    raise AssertionError("the exchange thread did not finish")


def test_exchange_takes_its_cpu_share_while_a_step_runs(monkeypatch):
    part, _ = _participant(monkeypatch, in_step=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    part.start(cpu_share=0.25)
    assert not part.progress()["done"]   # the caller is not blocked: the steps go on meanwhile
    report = _until_done(part)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    # share 0.25: each layer's 20 ms of CPU time is followed by a 60 ms pause, so the thread keeps to ~1/4 of a core
    # (the process's CPU time: the exchange thread's and the few of this polling loop).
    assert report["layers"] == LAYERS and report["sent_bytes"] == LAYERS * 1000
    assert report["paced_seconds"] >= LAYERS * LAYER_S * 3 * 0.9, report
    assert cpu / wall < 0.4, (report, cpu, wall)


def test_time_spent_waiting_for_a_peer_is_not_paced(monkeypatch):
    """The cap counts the thread's CPU time: a layer spent waiting for a peer (which may itself be pausing) adds no
    pause, so two peers' pauses never compound."""
    part, _ = _participant(monkeypatch, in_step=True, waits=True)
    part.start(cpu_share=0.25)
    report = _until_done(part)
    assert report["layers"] == LAYERS and report["paced_seconds"] < LAYERS * LAYER_S, report


def test_exchange_runs_at_full_speed_without_steps(monkeypatch):
    part, _ = _participant(monkeypatch, in_step=False)
    part.start(cpu_share=0.25)
    report = _until_done(part)
    assert report["layers"] == LAYERS and report["paced_seconds"] == 0.0


def test_a_step_started_during_a_layer_paces_it(monkeypatch):
    """A step that ran between two polls of the flag (started and ended within the layer) still counts."""
    def step_in_layer_2(worker, layer):
        worker.steps_started += layer == 2

    part, _ = _participant(monkeypatch, in_step=False, during_layer=step_in_layer_2)
    part.start(cpu_share=0.5)
    report = _until_done(part)
    # only the layer a step started in is paced: ~20 ms of pause at share 0.5
    assert LAYER_S * 0.9 <= report["paced_seconds"] < LAYER_S * 3, report


def test_wait_lifts_the_cap(monkeypatch):
    part, _ = _participant(monkeypatch, in_step=True)
    part.start(cpu_share=0.01)   # ~2 s of pause after every 20 ms layer
    time.sleep(0.05)
    started = time.perf_counter()
    report = part.wait()
    assert report["done"] and report["layers"] == LAYERS
    assert time.perf_counter() - started < 1.5


def test_a_new_share_from_a_step_takes_effect_from_the_next_layer(monkeypatch):
    """The control plane lifts the cap while requests queue for the memory the exchange frees: a step carries the
    new share (Worker.execute_pipeline), and the layers after it are no longer paced."""
    def lift_at_layer_2(worker, layer):
        if layer == 2:
            worker.part.set_cpu_share(1.0)

    part, worker = _participant(monkeypatch, in_step=True, during_layer=lift_at_layer_2)
    worker.part = part
    part.start(cpu_share=0.25)
    report = _until_done(part)
    # layers 0 and 1 paced (~60 ms each), layer 2 on: none
    assert LAYER_S * 3 * 2 * 0.9 <= report["paced_seconds"] < LAYER_S * 3 * 3, report
    with pytest.raises(ValueError, match=r"cpu_share must be in \(0, 1\], got 1.5"):
        part.set_cpu_share(1.5)


def test_failed_transfer_is_reported_and_abort_frees_the_participant(monkeypatch):
    part, worker = _participant(monkeypatch, in_step=False, fail_at=2)
    part.start(cpu_share=0.5)
    deadline = time.perf_counter() + 10
    with pytest.raises(RuntimeError, match="connection closed by peer"):
        while time.perf_counter() < deadline:
            part.progress()
            time.sleep(0.005)
    part.abort()
    assert not part.in_flight and worker.closed == ["old pool"]


def test_cpu_share_is_checked(monkeypatch):
    part, _ = _participant(monkeypatch, in_step=False)
    with pytest.raises(ValueError, match=r"cpu_share must be in \(0, 1\], got 0"):
        part.start(cpu_share=0)
