"""64 concurrent streaming clients (completions and chat, the real async openai client) all complete with the
engine's own greedy text, and the engine ends with every KV block free."""
from __future__ import annotations

import asyncio

import openai

from serving_helpers import MAX_TOKENS, PROMPTS

NUM_CLIENTS = 64
CHATS = ["Hi there!", "Tell me a joke."]


async def _completion(client, server, prompt):
    stream = await client.completions.create(model=server.model_id, prompt=prompt, max_tokens=MAX_TOKENS,
                                             temperature=0, stream=True)
    parts, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.text)
            finish = choice.finish_reason or finish
    return "".join(parts), finish, server.reference[prompt]


async def _chat(client, server, message):
    stream = await client.chat.completions.create(model=server.model_id,
                                                  messages=[{"role": "user", "content": message}],
                                                  max_tokens=MAX_TOKENS, temperature=0, stream=True)
    parts, finish = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, server.chat_reference[message]


async def _run_all(server):
    client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=server.api_key, max_retries=0,
                                timeout=300)
    jobs = []
    for i in range(NUM_CLIENTS):
        if i % 4 == 3:
            jobs.append(_chat(client, server, CHATS[i % len(CHATS)]))
        else:
            jobs.append(_completion(client, server, PROMPTS[i % len(PROMPTS)]))
    try:
        return await asyncio.gather(*jobs)
    finally:
        await client.close()


def test_64_concurrent_streams_complete_with_correct_text(tiny_server):
    steps_before = tiny_server.stats()["num_steps"]
    results = asyncio.run(_run_all(tiny_server))
    wrong = [i for i, (text, _, expected) in enumerate(results) if text != expected]
    assert not wrong, f"{len(wrong)} of {NUM_CLIENTS} clients got wrong text, e.g. {results[wrong[0]][:2]}"
    assert all(finish == "length" for _, finish, _ in results)
    # Continuous batching: 64 x 24 tokens took far fewer steps than one request at a time would.
    num_steps = tiny_server.stats()["num_steps"] - steps_before
    assert num_steps < NUM_CLIENTS * MAX_TOKENS / 4, f"{num_steps} steps: requests were not batched"
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0, stats
