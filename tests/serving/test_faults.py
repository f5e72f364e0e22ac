"""Faults under load, over real HTTP with the real `openai` client (loopback only, every wait bounded):

- a worker process SIGKILLed while its requests decode: the deployment replaces it and recomputes that instance's
  requests (Deployment.step -> recover), so every stream still completes with the exact greedy text, and the
  server serves correctly afterwards with every KV block free;
- a client that closes its stream while a reshape (POST /admin/reshape) or a precision morph (POST /admin/morph)
  is in flight costs the other streams nothing: they complete, the reshape commits / the morph lands, no block
  leaks.

Each in-flight window is held open on purpose (a reshape phase waits until the server saw the disconnect; a
morph's layer copy waits until the disconnected request left the engine), so the interleaving is certain, not
left to timing."""
from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from serving_helpers import PROMPTS, TINY_MAX_MODEL_LEN, StreamingClient, start_server

pytestmark = pytest.mark.stress   # see tests/conftest.py

ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
LONG_TOKENS = 300   # long enough that every stream is still decoding when the fault hits
WAIT_S = 60         # bound of every wait for a client or a server-side event


def _long_references(model, prompts) -> dict[str, str]:
    """Greedy text of LONG_TOKENS tokens per prompt, from the same engine before the server takes it over."""
    outs = model.generate(list(prompts), max_tokens=LONG_TOKENS, temperature=0.0, ignore_eos=True)
    assert all(len(o.outputs[0].token_ids) == LONG_TOKENS for o in outs)
    return {p: o.outputs[0].text for p, o in zip(prompts, outs)}


def _start_clients(server, prompts, *, leave: dict[int, threading.Event] | None = None) -> list[StreamingClient]:
    leave = leave or {}
    clients = [StreamingClient(server, p, LONG_TOKENS, ready_after=3, leave=leave.get(i), extra_body={
        "ignore_eos": True}) for i, p in enumerate(prompts)]
    for c in clients:
        c.start()
    for c in clients:
        assert c.ready.wait(WAIT_S), f"stream of {c.prompt!r} got no chunk within {WAIT_S} s"
        assert c.error is None and c.finish_reason is None, (c.prompt, c.error, c.finish_reason)
    return clients


def _join(clients, deadline_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + deadline_s
    for c in clients:
        c.join(max(0.0, deadline - time.monotonic()))
    hung = [c.prompt for c in clients if c.is_alive()]
    assert not hung, f"streams still open after {deadline_s} s: {hung}"


def _assert_exact(clients, reference) -> None:
    for c in clients:
        assert c.error is None, f"{c.prompt!r}: {c.error!r}"
        assert (c.finish_reason, c.completion_tokens) == ("length", LONG_TOKENS), (c.prompt, c.finish_reason,
                                                                                   c.completion_tokens)
        assert c.text == reference[c.prompt], f"{c.prompt!r}: greedy text differs from the reference"


def _wait_until(predicate, what: str, timeout: float = WAIT_S):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


def _assert_idle(server) -> dict:
    stats = server.wait_idle()
    assert (stats["kv_blocks_used"], stats["num_requests"], stats["num_streams"]) == (0, 0, 0), stats
    return stats


# ---------------------------------------------------------------------------------------------- 2 workers
@pytest.fixture(scope="module")
def deployment_server(serving_checkpoint):
    """An in-process server over a real 2-process deployment ([1,1]) with the admin routes."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, workers=2, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=16 << 20)
    try:
        reference = _long_references(model, PROMPTS[:6])
        handle, stop = start_server(model, admin_key=ADMIN_KEY)
    except BaseException:
        model.close()
        raise
    handle.reference = reference
    yield handle
    stop()
    model.close()


class _HoldReshape:
    """Holds a reshape between its prepare and its KV migration phase (the transaction is open: shards released,
    nothing committed) until the server has seen a client disconnect, i.e. until some stream aborts its request
    while the hold is on. The engine thread runs the reshape, so nothing else steps meanwhile and no stream can
    finish: an abort during the hold can only be the disconnect."""

    def __init__(self, server):
        self.deployment = server.model.deployment
        self.async_engine = server.async_engine
        self.holding = threading.Event()
        self.aborted = threading.Event()
        self.aborts_during_hold: set[str] = set()   # request ids (a response aborts its request more than once)
        self.timed_out = False

    def __enter__(self):
        pool, engine = self.deployment.pool, self.async_engine
        real_call_many, real_abort = pool.call_many, engine.abort

        def call_many(workers, method, *args):
            if method == "reshape.migrate_kv":
                self.holding.set()
                self.timed_out = not self.aborted.wait(WAIT_S)
                self.holding.clear()
            return real_call_many(workers, method, *args)

        def abort(request_id):
            if self.holding.is_set():
                self.aborts_during_hold.add(request_id)
                self.aborted.set()
            return real_abort(request_id)

        pool.call_many, engine.abort = call_many, abort
        return self

    def __exit__(self, *exc):
        del self.deployment.pool.call_many, self.async_engine.abort   # back to the class's methods


def _reshape_with_a_leaver(server, target: list[int], leaver: StreamingClient, leave: threading.Event) -> dict:
    with _HoldReshape(server) as hold, ThreadPoolExecutor(1) as pool:
        response = pool.submit(httpx.post, server.base_url + "/admin/reshape", json={"topology": target},
                               headers=ADMIN, timeout=WAIT_S + 30)
        assert hold.holding.wait(WAIT_S), "the reshape never reached its KV migration phase"
        leave.set()   # the client closes its connection while the transaction is open
        leaver.join(WAIT_S)
        resp = response.result(WAIT_S + 60)
    assert not hold.timed_out, "the server did not notice the client's disconnect during the reshape"
    assert len(hold.aborts_during_hold) == 1, hold.aborts_during_hold
    assert not leaver.is_alive() and leaver.closed_early and leaver.error is None, leaver.error
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_client_disconnect_during_reshape_loses_nothing_else(deployment_server):
    server = deployment_server
    dep = server.model.deployment
    assert str(dep.topology) == "[1,1]"
    aborts = server.metric("elastic_hf_requests_finished_total", 'finish_reason="abort"')
    committed = server.metric("elastic_hf_reshapes_total", 'outcome="committed"')
    leave_up, leave_down = threading.Event(), threading.Event()
    clients = _start_clients(server, PROMPTS[:6], leave={0: leave_up, 1: leave_down})
    leaver_up, leaver_down, stayers = clients[0], clients[1], clients[2:]

    up = _reshape_with_a_leaver(server, [2], leaver_up, leave_up)
    # Every request moved with its KV cache, the leaver's too (it was still in the engine: the abort came after).
    assert up["committed"] and up["new"] == "[2]" and up["num_moved_seqs"] == 6 and not up["preempted"], up
    assert all(c.is_alive() for c in stayers), "the stayers must still be streaming at the second reshape"
    down = _reshape_with_a_leaver(server, [1, 1], leaver_down, leave_down)
    assert down["committed"] and down["new"] == "[1,1]" and down["num_moved_seqs"] == 5, down

    _join(stayers)
    _assert_exact(stayers, server.reference)   # KV moved twice under them; not one token changed
    stats = _assert_idle(server)
    assert stats["topology"] == "[1,1]" and stats["num_step_errors"] == 0, stats
    assert server.metric("elastic_hf_requests_finished_total", 'finish_reason="abort"') == aborts + 2
    assert server.metric("elastic_hf_reshapes_total", 'outcome="committed"') == committed + 2


def test_worker_killed_mid_decode_is_replaced_and_every_stream_finishes_exactly(deployment_server):
    """Deployment.step: a WorkerError with a dead worker -> recover(): the dead process is replaced under the
    current topology, the requests of its instance are preempted and recomputed (their KV died with it); the other
    instance's requests go on untouched. So no stream fails: each one completes with the exact greedy text."""
    server = deployment_server
    dep = server.model.deployment
    assert str(dep.topology) == "[1,1]"
    victim = 1
    pids = dep.pool.pids()
    recoveries, step_errors = dep.num_recoveries, server.stats()["num_step_errors"]
    preemptions = [i["num_preemptions"] for i in server.stats()["instances"]]
    clients = _start_clients(server, PROMPTS[:6])
    per_instance = [i["num_requests"] for i in server.stats()["instances"]]
    assert all(n > 0 for n in per_instance), per_instance   # the victim's instance has requests mid-decode
    assert all(c.is_alive() and c.finish_reason is None for c in clients)

    os.kill(pids[victim], signal.SIGKILL)
    _join(clients)

    _assert_exact(clients, server.reference)
    new_pids = dep.pool.pids()
    assert new_pids[victim] != pids[victim] and new_pids[1 - victim] == pids[1 - victim], (pids, new_pids)
    assert dep.num_recoveries == recoveries + 1
    stats = server.stats()
    assert stats["num_step_errors"] == step_errors, stats.get("last_step_error")
    # Exactly the victim instance's requests were recomputed (preempted once each); the other's went on.
    delta = [i["num_preemptions"] - b for i, b in zip(stats["instances"], preemptions)]
    assert delta[victim] == per_instance[victim] and delta[1 - victim] == 0, (delta, per_instance)
    assert server.metric("elastic_hf_worker_replacements_total") >= 1
    _assert_idle(server)

    # Afterwards both instances (the replacement's included) serve the exact greedy text again.
    steps = [i["num_steps"] for i in server.stats()["instances"]]
    after = _start_clients(server, PROMPTS[2:4])
    _join(after)
    _assert_exact(after, server.reference)
    assert all(s > b for s, b in zip([i["num_steps"] for i in server.stats()["instances"]], steps))
    _assert_idle(server)


# ---------------------------------------------------------------------------------------------- morph
class _GatedCopier:
    """Stands in for the worker's layer copier: every copy waits for `gate` on a copy thread of its own, so a
    forced morph stays in flight (target slot committed, layer not switched) while the engine keeps stepping."""

    def __init__(self, inner):
        self.inner = inner
        self.gate = threading.Event()
        self.started = threading.Event()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="gated-copy")

    def submit(self, dst, src):
        import torch

        from elastic_hf.morph.copier import CopyHandle

        def copy() -> float:
            if not self.gate.wait(WAIT_S):
                raise TimeoutError("the test never opened the copy gate")
            started = time.perf_counter()
            with torch.no_grad():
                dst.copy_(src)
            return time.perf_counter() - started

        self.started.set()
        handle = CopyHandle(future=self.executor.submit(copy))
        handle.nbytes = src.numel()
        return handle

    def sync_compute(self) -> None:
        self.inner.sync_compute()


@pytest.fixture(scope="module")
def morph_server(serving_checkpoint):
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=8 << 20, morph="manual", morph_options={"use_cache": False})
    reference = _long_references(model, PROMPTS[:5])
    handle, stop = start_server(model, admin_key=ADMIN_KEY)
    handle.reference = reference
    yield handle
    stop()
    model.close()


def _morph(server, precision: str, leaver: StreamingClient, leave: threading.Event, stayers) -> dict:
    swapper = server.model.deployment.pool.worker.morph.swapper
    gated = _GatedCopier(swapper.copier)
    swapper.copier = gated
    requests_before = server.stats()["num_requests"]
    try:
        with ThreadPoolExecutor(1) as pool:
            response = pool.submit(httpx.post, server.base_url + "/admin/morph",
                                   json={"layers": "all", "precision": precision}, headers=ADMIN,
                                   timeout=WAIT_S + 30)
            assert gated.started.wait(WAIT_S), "the morph never started a layer copy"
            leave.set()   # the client goes away while the swap is in flight
            leaver.join(WAIT_S)
            # The engine keeps stepping during the copy: the aborted request leaves it before any layer switches.
            _wait_until(lambda: server.stats()["num_requests"] == requests_before - 1, "the leaver's abort")
            state = httpx.get(server.base_url + "/admin/morph", headers=ADMIN, timeout=30).json()
            assert state["layer_counts"]["fp" if precision != "w4" else "w8"] == 3, state   # nothing switched yet
            for c in stayers:
                c.mark(precision)   # everything streamed so far was computed before the swap
            gated.gate.set()
            resp = response.result(WAIT_S + 60)
    finally:
        gated.gate.set()
        swapper.copier = gated.inner
        gated.executor.shutdown(wait=True)
    assert not leaver.is_alive() and leaver.closed_early and leaver.error is None, leaver.error
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_client_disconnect_during_morph_loses_nothing_else(morph_server):
    """Under a morph the stayers' text legitimately changes once their layers run W8/W4 (different weights,
    different greedy tokens), so past the swap they are checked for completion, finish reason and token counts,
    not text. Up to the first swap they ran full precision: what they had streamed by then is a prefix of the
    reference, and after restoring fp a new request gives the reference exactly again."""
    server = morph_server
    aborts = server.metric("elastic_hf_requests_finished_total", 'finish_reason="abort"')
    leave_w8, leave_w4 = threading.Event(), threading.Event()
    clients = _start_clients(server, PROMPTS[:5], leave={0: leave_w8, 1: leave_w4})
    leaver_w8, leaver_w4, stayers = clients[0], clients[1], clients[2:]

    state = _morph(server, "w8", leaver_w8, leave_w8, stayers)
    assert state["layer_counts"]["w8"] == 3 and state["pending"] == [], state
    assert all(c.is_alive() for c in stayers), "the stayers must still be streaming at the second morph"
    state = _morph(server, "w4", leaver_w4, leave_w4, stayers)
    assert state["layer_counts"]["w4"] == 3 and state["pending"] == [], state

    _join(stayers)
    for c in stayers:
        assert c.error is None, f"{c.prompt!r}: {c.error!r}"
        assert (c.finish_reason, c.completion_tokens) == ("length", LONG_TOKENS), (c.prompt, c.finish_reason,
                                                                                   c.completion_tokens)
        assert c.text_at["w8"] and server.reference[c.prompt].startswith(c.text_at["w8"]), c.prompt
        assert c.text.startswith(c.text_at["w4"]) and len(c.text) > len(c.text_at["w4"])
    _assert_idle(server)
    assert server.metric("elastic_hf_requests_finished_total", 'finish_reason="abort"') == aborts + 2

    back = httpx.post(server.base_url + "/admin/morph", json={"layers": "all", "precision": "fp"}, headers=ADMIN,
                      timeout=WAIT_S)
    assert back.status_code == 200 and back.json()["layer_counts"]["fp"] == 3, back.text
    after = _start_clients(server, PROMPTS[2:4])
    _join(after)
    _assert_exact(after, server.reference)
    _assert_idle(server)
