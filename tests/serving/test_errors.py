"""Engine errors become OpenAI-style bodies by their type and attributes, not by their wording: the unit mapping
(`api_error_from_engine`), the `param` / `code` a real client sees for engine-validated input, and the 503 of a
stopped engine, before and during a request."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from elastic_hf.engine.errors import EngineDeadError, EngineError, InvalidRequest
from elastic_hf.serving.errors import api_error_from_engine, error_response, sse_error_event
from serving_helpers import PROMPTS, TINY_MAX_MODEL_LEN, start_server


@pytest.mark.parametrize("exc, status, type_, param, code", [
    # the message names another field on purpose: param and code come from the attributes only
    (InvalidRequest("max_tokens is not the culprit here", param="prompt", code="context_length_exceeded"),
     400, "invalid_request_error", "prompt", "context_length_exceeded"),
    (InvalidRequest("top_p must be in (0, 1], got 2", param="top_p"), 400, "invalid_request_error", "top_p", None),
    (ValueError("max_tokens must be an integer >= 1, got 0"), 400, "invalid_request_error", None, None),
    (EngineDeadError("the engine is not running"), 503, "server_error", None, "engine_unavailable"),
    (EngineError("engine step failed: RuntimeError: boom"), 500, "server_error", None, "engine_error"),
])
def test_api_error_from_engine_maps_by_type(exc, status, type_, param, code):
    error = api_error_from_engine(exc)
    assert (error.status, error.type, error.param, error.code) == (status, type_, param, code)
    assert error.message == str(exc)
    body = json.loads(error.response().body)
    assert error.response().status_code == status
    assert body == {"error": {"message": str(exc), "type": type_, "param": param, "code": code}}


def test_sse_error_event_uses_the_same_body():
    line = sse_error_event(EngineError("engine step failed: boom"))
    assert line.startswith("data: ") and line.endswith("\n\n")
    event = json.loads(line[len("data: "):])
    http_body = json.loads(error_response(500, "x", type="server_error", code="500").body)
    assert set(event["error"]) == set(http_body["error"]) == {"message", "type", "param", "code"}
    assert event["error"] == {"message": "engine step failed: boom", "type": "server_error", "param": None,
                              "code": "500"}


def _cases(model_id: str):
    """(name, body, param, code) of input that only the engine or SamplingParams can judge."""
    ok = {"model": model_id, "prompt": "Hello"}
    return [
        ("prompt + max_tokens beyond limit", {**ok, "prompt": "hello " * (TINY_MAX_MODEL_LEN - 10), "max_tokens": 100},
         "max_tokens", "context_length_exceeded"),
        ("prompt too long", {**ok, "prompt": [1000] * (TINY_MAX_MODEL_LEN + 200)}, "prompt", "context_length_exceeded"),
        ("empty prompt", {**ok, "prompt": ""}, "prompt", None),
        ("token id out of vocab", {**ok, "prompt": [1, 2, 10**9]}, "prompt", None),
        ("negative temperature", {**ok, "temperature": -0.5}, "temperature", None),
        ("top_p zero", {**ok, "top_p": 0}, "top_p", None),
        ("top_k negative", {**ok, "top_k": -1}, "top_k", None),
        ("repetition_penalty zero", {**ok, "repetition_penalty": 0}, "repetition_penalty", None),
        ("n zero", {**ok, "n": 0}, "n", None),
        ("empty stop string", {**ok, "stop": [""]}, "stop", None),
        ("negative stop token id", {**ok, "stop_token_ids": [-1]}, "stop_token_ids", None),
    ]


def test_engine_validation_param_and_code_over_http(tiny_server):
    failures = []
    with httpx.Client(base_url=tiny_server.base_url, headers=tiny_server.headers, timeout=60) as client:
        for name, body, param, code in _cases(tiny_server.model_id):
            resp = client.post("/v1/completions", json=body)
            error = resp.json()["error"]
            got = (resp.status_code, error["type"], error["param"], error["code"])
            if got != (400, "invalid_request_error", param, code):
                failures.append(f"{name}: {got}, want {(400, 'invalid_request_error', param, code)}")
    assert not failures, "\n".join(failures)


def test_openai_client_sees_param_and_code(tiny_server):
    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key=tiny_server.api_key, max_retries=0,
                           timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=tiny_server.model_id, prompt="hello " * (TINY_MAX_MODEL_LEN - 10),
                                  max_tokens=100)
    assert info.value.param == "max_tokens" and info.value.code == "context_length_exceeded"
    assert str(TINY_MAX_MODEL_LEN) in info.value.message


def test_stopped_engine_is_503_before_and_during_a_request(serving_checkpoint):
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=16 << 20)
    server, stop = start_server(model)
    try:
        body = {"model": server.model_id, "prompt": PROMPTS[0], "max_tokens": TINY_MAX_MODEL_LEN - 100,
                "temperature": 0, "ignore_eos": True}
        result = {}

        def long_request():
            result["resp"] = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=long_request)
        thread.start()
        deadline = time.monotonic() + 60
        while server.stats().get("num_requests", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.stats().get("num_requests", 0) > 0, "the long request never reached the engine"
        server.async_engine.shutdown()
        thread.join(60)
        during = result["resp"]
        assert during.status_code == 503, during.text
        assert during.json()["error"]["type"] == "server_error"
        assert during.json()["error"]["code"] == "engine_unavailable"

        before = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=30)
        assert before.status_code == 503 and before.json()["error"]["code"] == "engine_unavailable"
        assert httpx.get(server.base_url + "/health", timeout=30).status_code == 503
    finally:
        stop()
