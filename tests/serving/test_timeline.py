"""`--timeline` (EngineConfig.timeline): every finished request gets a record under the id its client saw, with
arrival <= admission <= first token <= finish, and the step records account for every prompt token and every
decode the requests made (engine/timeline.py)."""
import threading

import pytest

from elastic_hf.engine.timeline import read_timeline
from serving_helpers import start_server


@pytest.fixture
def timeline_server(serving_checkpoint, tmp_path):
    from elastic_hf import ElasticModel

    path = tmp_path / "logs" / "timeline.jsonl"
    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=256, kv_cache_memory=8 << 20,
                                         max_num_batched_tokens=32, enable_prefix_caching=False, timeline=str(path))
    handle, stop = start_server(model)
    yield handle, path
    stop()
    model.close()


def test_timeline_names_client_ids_and_accounts_for_every_token(timeline_server):
    import openai

    server, path = timeline_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    seen: dict[str, tuple[int, int]] = {}   # engine request id -> (prompt tokens, output tokens)

    def chat(i: int) -> None:
        stream = client.chat.completions.create(
            model=server.model_id, messages=[{"role": "user", "content": f"Tell me about the number {i}. " * 4}],
            max_tokens=5 + i, temperature=0.0, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        usage = chunks[-1].usage
        seen[chunks[0].id] = (usage.prompt_tokens, usage.completion_tokens)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # two prompts in one completion request: the engine's ids are the response's id with -0 / -1
    batch = client.completions.create(model=server.model_id, prompt=["One two three four five", "Six seven"],
                                      max_tokens=3, temperature=0.0)
    for t in threads:
        t.join()
    steps, requests = read_timeline(path)
    pair = [requests[f"{batch.id}-{i}"] for i in range(2)]
    assert sum(r["prompt_tokens"] for r in pair) == batch.usage.prompt_tokens
    for i, record in enumerate(pair):
        seen[f"{batch.id}-{i}"] = (record["prompt_tokens"], 3)
    assert set(requests) == set(seen)
    for request_id, (prompt_tokens, output_tokens) in seen.items():
        record = requests[request_id]
        assert record["arrival"] <= record["scheduled"] <= record["first_token"] <= record["finish"], record
        assert (record["prompt_tokens"], record["output_tokens"]) == (prompt_tokens, output_tokens), request_id
        assert record["finish_reason"] == "length" and record["preemptions"] == 0
        # a budget of 32 tokens a step: a prompt of p tokens takes at least ceil(p / 32) chunks
        assert record["chunks"] >= -(-prompt_tokens // 32)
    assert sum(s["prefill_tokens"] for s in steps) == sum(p for p, _ in seen.values())
    assert sum(s["decode_seqs"] for s in steps) == sum(o - 1 for _, o in seen.values())
    assert all(s["prefill_tokens"] <= 32 and s["start"] <= s["end"] for s in steps)
    assert all(a["end"] <= b["start"] for a, b in zip(steps, steps[1:]))


def test_a_timeline_that_cannot_write_stops_recording_not_serving(tmp_path, caplog):
    from elastic_hf.engine.timeline import Timeline

    timeline = Timeline(tmp_path / "t.jsonl")
    timeline.on_step(1.0, 2.0, (4, 1, 0), admitted=1, waiting=0, running=1, kv_used=1, kv_total=8, preemptions=0)
    timeline.close()   # as a full disk would: every further write fails
    timeline.on_step(2.0, 3.0, (0, 0, 1), admitted=0, waiting=0, running=1, kv_used=1, kv_total=8, preemptions=0)
    timeline.on_step(3.0, 4.0, (0, 0, 1), admitted=0, waiting=0, running=1, kv_used=1, kv_total=8, preemptions=0)
    steps, requests = read_timeline(tmp_path / "t.jsonl")
    assert len(steps) == 1 and not requests
    assert sum("writing failed" in r.message for r in caplog.records) == 1   # said once, then quiet
