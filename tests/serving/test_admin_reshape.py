"""`elastic-hf serve --workers 2`: a real two-process deployment behind the HTTP server; POST /admin/reshape
merges the two TP1 instances into one TP2 instance and splits them back while the server keeps answering the
same greedy text."""
import os

import httpx
import pytest

from test_cli import start_cli_server, stop_cli_server

ADMIN = {"Authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def deployment_server(serving_checkpoint):
    env = {**os.environ, "ELASTIC_HF_ADMIN_KEY": "admin-secret"}
    proc, base = start_cli_server([serving_checkpoint, "--workers", "2", "--kv-cache-memory", "16MiB",
                                   "--max-model-len", "256", "--log-level", "warning"], env)
    yield base
    stop_cli_server(proc)


def _complete(base: str, prompt: str) -> str:
    model = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]
    resp = httpx.post(base + "/v1/completions", timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def test_reshape_through_admin_route_keeps_answers(deployment_server):
    base = deployment_server
    prompts = ["The quick brown fox", "Once upon a time, in a land far away,"]
    before = [_complete(base, p) for p in prompts]

    assert httpx.post(base + "/admin/reshape", json={"topology": [2]}, timeout=30).status_code == 401
    bad = httpx.post(base + "/admin/reshape", json={"topology": [3]}, headers=ADMIN, timeout=30)
    assert bad.status_code == 400 and "not a candidate" in bad.json()["error"]["message"]

    merged = httpx.post(base + "/admin/reshape", json={"topology": [2]}, headers=ADMIN, timeout=120)
    assert merged.status_code == 200, merged.text
    assert merged.json()["committed"] and merged.json()["new"] == "[2]"
    assert httpx.get(base + "/admin/reshape", headers=ADMIN, timeout=10).json()["topology"] == [2]
    assert [_complete(base, p) for p in prompts] == before  # TP2 gives the TP1 tokens

    split = httpx.post(base + "/admin/reshape", json={"topology": [1, 1]}, headers=ADMIN, timeout=120)
    assert split.status_code == 200 and split.json()["new"] == "[1,1]"
    assert [_complete(base, p) for p in prompts] == before
    assert "elastic_hf" in httpx.get(base + "/metrics", timeout=10).text
