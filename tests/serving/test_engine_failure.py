"""A failing engine step (a kernel error, a bug) fails the requests in flight with an OpenAI-style error, frees
their blocks, and the server keeps serving correct text afterwards."""
from __future__ import annotations

import json

import httpx
import pytest

from serving_helpers import MAX_TOKENS, PROMPTS, TINY_MAX_MODEL_LEN, start_server


@pytest.fixture(scope="module")
def flaky_server(serving_checkpoint):
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=16 << 20)
    engine = model.engine
    real_step = engine.step
    state = {"fail_at_step": None}

    def step():
        if state.get("always"):
            raise RuntimeError("injected step failure (secret detail)")
        if state["fail_at_step"] is not None and engine.num_steps >= state["fail_at_step"]:
            state["fail_at_step"] = None
            raise RuntimeError("injected step failure")
        return real_step()

    handle, stop = start_server(model, prompts=PROMPTS[:1])
    engine.step = step  # after the reference run: only served requests see the failure
    handle.fail_soon = lambda: state.__setitem__("fail_at_step", engine.num_steps + 3)
    handle.fail_always = lambda on: state.__setitem__("always", on)
    yield handle
    stop()


def test_stream_gets_error_event_then_server_recovers(flaky_server):
    server = flaky_server
    server.fail_soon()
    body = {"model": server.model_id, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected step failure" in error["message"] and error["type"] == "server_error"
    stats = server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["num_step_errors"] == 1, stats

    resp = httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"model": server.model_id, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                            "temperature": 0})
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == server.reference[PROMPTS[0]]


def test_non_streaming_gets_500_body(flaky_server):
    server = flaky_server
    server.fail_soon()
    resp = httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"model": server.model_id, "prompt": PROMPTS[0], "max_tokens": 200})
    assert resp.status_code == 500
    assert "injected step failure" in resp.json()["error"]["message"]
    assert server.wait_idle()["kv_blocks_used"] == 0


def test_health_turns_503_when_steps_keep_failing_and_recovers(flaky_server):
    """Every step failing (a hung or broken worker, a kernel bug) used to leave /health at 200; now three failures
    in a row make it 503 until a step succeeds, and the error text stays out of the public /health body."""
    server = flaky_server
    server.fail_always(True)
    body = {"model": server.model_id, "prompt": PROMPTS[0], "max_tokens": 4}
    try:
        for _ in range(3):
            assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 500
        health = httpx.get(server.base_url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"].startswith("unhealthy")
        assert health.json()["consecutive_step_errors"] >= 3 and "secret detail" not in health.text
    finally:
        server.fail_always(False)
    assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
