"""`elastic-hf serve --workers 2`: POST /admin/drop drops replicated layers while streamed completions run through
the real `openai` client, GET /admin/drop shows the exchange and the history, /metrics counts the drop and the
freed weight bytes, POST /admin/restore brings the layers back; every answer equals the one before the drop."""
import concurrent.futures
import os

import httpx
import openai
import pytest

from test_cli import start_cli_server, stop_cli_server

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,", "The history of the Roman Empire"]


@pytest.fixture(scope="module")
def drop_server(serving_checkpoint):
    env = {**os.environ, "ELASTIC_HF_ADMIN_KEY": "admin-secret"}
    proc, base = start_cli_server([serving_checkpoint, "--workers", "2", "--kv-cache-memory", "256KiB",
                                   "--max-model-len", "256", "--log-level", "warning"], env)
    yield base
    stop_cli_server(proc)


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=300)


def _stream(base: str, prompt: str, max_tokens: int = 24) -> str:
    client = _client(base)
    model = client.models.list().data[0].id
    chunks = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_admin_drop_and_restore_over_http_keep_the_answers(drop_server):
    base = drop_server
    before = [_stream(base, p) for p in PROMPTS]
    assert httpx.post(base + "/admin/drop", json={}, timeout=30).status_code == 401
    bad = httpx.post(base + "/admin/drop", json={"demand_tokens": 0}, headers=ADMIN, timeout=30)
    assert bad.status_code == 400 and "demand_tokens" in bad.text
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) * 2) as pool:
        during = [pool.submit(_stream, base, p, 24) for p in PROMPTS * 2]   # in flight while the layers drop
        resp = httpx.post(base + "/admin/drop", headers=ADMIN, timeout=120)   # empty body: the smallest drop
        assert resp.status_code == 200, resp.text
        assert resp.json()["new"].startswith("[1x2") and resp.json()["committed"]
        answers = [f.result() for f in during]
    assert answers == before * 2
    state = httpx.get(base + "/admin/drop", headers=ADMIN, timeout=30).json()
    assert state["topology"].startswith("[1x2") and state["history"][0]["event"] == "drop"
    assert [_stream(base, p) for p in PROMPTS] == before   # served by the pipeline group
    metrics = httpx.get(base + "/metrics", timeout=30).text
    assert 'elastic_hf_param_drops_total{outcome="committed"} 1.0' in metrics
    dropped = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("elastic_hf_dropped_weight_bytes{")]
    assert len(dropped) == 2 and all(b > 0 for b in dropped)
    again = httpx.post(base + "/admin/drop", headers=ADMIN, timeout=120)
    assert again.status_code == 409 and "no parameter drop" in again.json()["error"]["message"]
    restored = httpx.post(base + "/admin/restore", headers=ADMIN, timeout=120)
    assert restored.status_code == 200 and restored.json()["restored"] and restored.json()["new"] == "[1,1]"
    assert [_stream(base, p) for p in PROMPTS] == before
