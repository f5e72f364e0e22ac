"""The real `openai` client against a server started by the test: completions and chat, streaming and not.
Greedy text from the server must equal the engine's own greedy text for the same prompt."""
from __future__ import annotations

import httpx
import openai
import pytest

from serving_helpers import MAX_TOKENS, PROMPTS


def client_for(server, api_key=None) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=api_key or server.api_key or "none",
                         max_retries=0, timeout=120)


def test_models_lists_the_served_model(tiny_server):
    models = client_for(tiny_server).models.list()
    assert [m.id for m in models.data] == [tiny_server.model_id]


def test_completion_greedy_equals_engine(tiny_server):
    client = client_for(tiny_server)
    for prompt in PROMPTS[:3]:
        resp = client.completions.create(model=tiny_server.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                         temperature=0)
        assert resp.choices[0].text == tiny_server.reference[prompt]
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.completion_tokens == MAX_TOKENS
        assert resp.usage.prompt_tokens > 0
        assert resp.usage.total_tokens == resp.usage.prompt_tokens + MAX_TOKENS


def test_completion_batch_prompts_keep_order(tiny_server):
    resp = client_for(tiny_server).completions.create(model=tiny_server.model_id, prompt=PROMPTS[:4],
                                                      max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [tiny_server.reference[p] for p in PROMPTS[:4]]
    assert resp.usage.completion_tokens == 4 * MAX_TOKENS


def test_completion_stream_equals_engine(tiny_server):
    prompt = PROMPTS[4]
    stream = client_for(tiny_server).completions.create(
        model=tiny_server.model_id, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tiny_server.reference[prompt]
    assert len([c for c in chunks if c.choices]) > 1, "streaming must deliver more than one chunk"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_greedy_equals_engine_stream_and_not(tiny_server):
    client = client_for(tiny_server)
    message = "Hi there!"
    resp = client.chat.completions.create(model=tiny_server.model_id, messages=[{"role": "user", "content": message}],
                                          max_tokens=MAX_TOKENS, temperature=0)
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == tiny_server.chat_reference[message]
    assert resp.usage.completion_tokens == MAX_TOKENS

    stream = client.chat.completions.create(model=tiny_server.model_id,
                                            messages=[{"role": "user", "content": message}],
                                            max_completion_tokens=MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == tiny_server.chat_reference[message]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens


def test_seeded_sampling_repeats_and_n_gives_n_choices(tiny_server):
    client = client_for(tiny_server)
    kwargs = dict(model=tiny_server.model_id, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, top_p=0.9, seed=7,
                  n=2, extra_body={"top_k": 50, "repetition_penalty": 1.1})
    a = client.completions.create(**kwargs)
    b = client.completions.create(**kwargs)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_raw_sse_ends_with_done(tiny_server):
    body = {"model": tiny_server.model_id, "prompt": PROMPTS[0], "max_tokens": 4, "stream": True}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json=body, headers=tiny_server.headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_auth_required_on_v1_only(tiny_server):
    with pytest.raises(openai.AuthenticationError) as info:
        client_for(tiny_server, api_key="wrong-key").models.list()
    assert info.value.status_code == 401
    resp = httpx.post(tiny_server.base_url + "/v1/completions",
                      json={"model": tiny_server.model_id, "prompt": "x"}, timeout=30)
    assert resp.status_code == 401 and "Bearer" in resp.json()["error"]["message"]
    assert httpx.get(tiny_server.base_url + "/health", timeout=30).status_code == 200


def test_metrics_exposes_engine_counters(tiny_server):
    client_for(tiny_server).completions.create(model=tiny_server.model_id, prompt=PROMPTS[0], max_tokens=3)
    text = httpx.get(tiny_server.base_url + "/metrics", timeout=30).text
    for name in ("elastic_hf_requests_total", "elastic_hf_prompt_tokens_total", "elastic_hf_generation_tokens_total",
                 "elastic_hf_time_to_first_token_seconds_bucket", "elastic_hf_time_per_output_token_seconds_bucket",
                 "elastic_hf_kv_blocks_used", "elastic_hf_kv_blocks_total", "elastic_hf_num_requests_waiting",
                 "elastic_hf_preemptions_total"):
        assert name in text, name
    assert tiny_server.metric("elastic_hf_generation_tokens_total") >= 3
    assert tiny_server.metric("elastic_hf_kv_blocks_total") == tiny_server.stats()["kv_blocks_total"]


@pytest.mark.slow
def test_default_model_quality_through_client(default_server):
    client = client_for(default_server)
    prompt = "The capital of France is"
    resp = client.completions.create(model=default_server.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0)
    assert resp.choices[0].text == default_server.reference[prompt]
    message = "What is the capital of France? Answer in one word."
    stream = client.chat.completions.create(model=default_server.model_id,
                                            messages=[{"role": "user", "content": message}],
                                            max_tokens=MAX_TOKENS, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == default_server.chat_reference[message]
    assert "Paris" in text
