"""The prefix cache through HTTP with the real openai client: usage.prompt_tokens_details.cached_tokens of a chat
whose history was computed by the previous turn, the same answers as a cold cache, vLLM's prefix-cache counters on
/metrics, cache_salt isolation, and POST /reset_prefix_cache behind the admin key."""
from __future__ import annotations

import re

import httpx
import openai
import pytest

from serving_helpers import tiny_model_server

ADMIN_KEY = "cache-admin"


@pytest.fixture(scope="module")
def server(serving_checkpoint):
    with tiny_model_server(serving_checkpoint, admin_key=ADMIN_KEY) as handle:
        yield handle


def _client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _counter(server, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    return sum(float(v) for v in re.findall(rf"^vllm:{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def test_a_second_turn_reports_its_cached_history_and_answers_as_a_cold_cache(server):
    client = _client(server)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    system = "You are a terse assistant. " + " ".join(f"Fact {i}: the number {i} is {'odd' if i % 2 else 'even'}."
                                                      for i in range(12))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Which numbers are odd?"}]
    first = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And which are even?"}]
    hits_before = _counter(server, "prefix_cache_hits")
    warm = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=8, temperature=0)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens // 16 * 16 - 16 and cached % 16 == 0
    assert _counter(server, "prefix_cache_hits") - hits_before == cached
    assert _counter(server, "prefix_cache_queries") >= first.usage.prompt_tokens + warm.usage.prompt_tokens

    # Another tenant's salt finds nothing; streaming reports the same usage.
    salted = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=8, temperature=0,
                                            extra_body={"cache_salt": "tenant-b"}, stream=True,
                                            stream_options={"include_usage": True})
    usage = [c.usage for c in salted if c.usage is not None][-1]
    assert usage.prompt_tokens_details.cached_tokens == 0

    assert httpx.post(server.base_url + "/reset_prefix_cache").status_code == 401
    assert httpx.post(server.base_url + "/reset_prefix_cache",
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    reset = httpx.post(server.base_url + "/reset_prefix_cache", headers=admin)
    assert reset.status_code == 200 and reset.json()["forgotten_blocks"] > 0
    cold = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=8, temperature=0)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == warm.choices[0].message.content
    state = httpx.get(server.base_url + "/admin/prefix_cache", headers=admin).json()
    assert state["enabled"] and state["blocks"] > 0 and state["hit_tokens"] >= cached
