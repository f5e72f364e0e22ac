"""Responses are what the `openai` SDK's own types say they are: raw JSON round-trips through the SDK models
unchanged; one `id`, one `created` and the `system_fingerprint` across a stream's chunks; `usage` only when the client
asks for it (`stream_options.include_usage`, vLLM's `continuous_usage_stats`); /v1/models has vLLM's fields; a request
whose sampling raises inside the engine fails alone while 8 others finish."""
from __future__ import annotations

import json
import threading

import httpx
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from serving_helpers import MAX_TOKENS, PROMPTS


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": server.model_id, **body}, headers=server.headers,
                      timeout=120)


def sse_events(server, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", server.base_url + path, json={"model": server.model_id, "stream": True, **body},
                      headers=server.headers, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def round_trips(sdk_type, raw: dict) -> None:
    parsed = sdk_type.model_validate(raw)    # strict pydantic validation, not the SDK's lenient construct()
    assert parsed.model_dump(mode="json", exclude_unset=True) == raw


def test_responses_round_trip_through_the_sdk_types(tiny_server):
    chat = {"messages": [{"role": "user", "content": "Hi there!"}], "max_tokens": 8, "temperature": 0}
    for body in (chat, {**chat, "logprobs": True, "top_logprobs": 2}, {**chat, "n": 2, "temperature": 1.0}):
        raw = post(tiny_server, "/v1/chat/completions", body).json()
        round_trips(ChatCompletion, raw)
        assert raw["system_fingerprint"].startswith("fp_")
    completion = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
    for body in (completion, {**completion, "logprobs": 2}):
        round_trips(Completion, post(tiny_server, "/v1/completions", body).json())
    # With echo the first prompt token has null logprob and alternatives, as OpenAI's own API answers; the SDK's
    # types declare plain floats there and its client parses such bodies leniently: check that it does.
    from openai import OpenAI
    client = OpenAI(base_url=tiny_server.base_url + "/v1", api_key=tiny_server.api_key, max_retries=0)
    echoed = client.completions.create(model=tiny_server.model_id, prompt=PROMPTS[0], max_tokens=4, logprobs=2,
                                       echo=True, temperature=0)
    assert echoed.choices[0].logprobs.token_logprobs[0] is None
    assert all(isinstance(v, float) for v in echoed.choices[0].logprobs.token_logprobs[1:])
    for event in sse_events(tiny_server, "/v1/chat/completions", {**chat, "logprobs": True}):
        round_trips(ChatCompletionChunk, event)
    for event in sse_events(tiny_server, "/v1/completions", {**completion, "logprobs": 1}):
        # The SDK parses completion stream chunks as Completion, whose finish_reason is not optional although
        # OpenAI's stream sends null until the last chunk: validate everything else.
        for choice in event["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "length"
        round_trips(Completion, event)
    models = httpx.get(tiny_server.base_url + "/v1/models", headers=tiny_server.headers, timeout=30).json()
    card = models["data"][0]
    round_trips(Model, card)
    assert card["root"] == tiny_server.model.model_id and card["parent"] is None
    assert card["permission"][0]["object"] == "model_permission" and card["permission"][0]["allow_logprobs"]


def test_one_id_created_and_fingerprint_per_stream(tiny_server):
    events = sse_events(tiny_server, "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Tell me a joke."}], "max_tokens": MAX_TOKENS,
                         "temperature": 0, "ignore_eos": True})
    assert len(events) > 3
    assert len({(e["id"], e["created"], e["system_fingerprint"]) for e in events}) == 1


def test_usage_only_when_asked(tiny_server):
    body = {"prompt": PROMPTS[1], "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    plain = sse_events(tiny_server, "/v1/completions", body)
    assert all("usage" not in e for e in plain)

    final_only = sse_events(tiny_server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(e["usage"] is None for e in final_only[:-1])
    assert final_only[-1]["choices"] == [] and final_only[-1]["usage"]["completion_tokens"] == 10

    continuous = sse_events(tiny_server, "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Hi there!"}], "max_tokens": 10,
                             "temperature": 0, "ignore_eos": True,
                             "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    counts = [e["usage"]["completion_tokens"] for e in continuous]
    assert counts == sorted(counts) and counts[-1] == 10 and len(set(counts)) > 2
    assert all(e["usage"]["prompt_tokens"] == continuous[-1]["usage"]["prompt_tokens"] for e in continuous[1:])


def test_request_whose_sampling_raises_fails_alone(tiny_server, monkeypatch):
    """Fault injection at the sampler: requests with seed 4242 get a logits processor that raises (as NaN logits
    make the sampler raise). That request gets a 500 naming the failure; 8 concurrent streams finish with
    their exact greedy text; no block is left behind."""
    import elastic_hf.engine.llm_engine as llm_engine

    real = llm_engine.make_sampler_state

    def with_fault(seq, *args):
        state = real(seq, *args)
        if seq.params.seed == 4242:
            def explode(input_ids, scores):
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
            state.processors.append(explode)
        return state

    monkeypatch.setattr(llm_engine, "make_sampler_state", with_fault)
    results: dict[int, str] = {}

    def stream(i: int) -> None:
        events = sse_events(tiny_server, "/v1/completions",
                            {"prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "temperature": 0})
        results[i] = "".join(c["text"] for e in events for c in e["choices"])

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    failed = post(tiny_server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 50, "seed": 4242,
                                                   "temperature": 1.0})
    for t in threads:
        t.join(120)
    assert failed.status_code == 500, failed.text
    assert "sampling failed" in failed.json()["error"]["message"]
    assert results == {i: tiny_server.reference[PROMPTS[i]] for i in range(8)}
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there!"}], "logprobs": True,
                              "top_logprobs": 21}),
    ("/v1/completions", {"prompt": "Hello", "logprobs": -1}),
])
def test_logprobs_out_of_range_is_a_400(tiny_server, path, body):
    resp = post(tiny_server, path, {**body, "max_tokens": 4})
    assert resp.status_code == 400
    assert "[0, 20]" in resp.json()["error"]["message"]
