"""`elastic-hf serve --workers 2`: a real two-process deployment behind the HTTP server; POST /admin/reshape
merges the two TP1 instances into one TP2 instance and splits them back while the server keeps answering the
same greedy text."""
import os
import signal
import socket
import subprocess
import time

import httpx
import pytest

from test_cli import _cli

ADMIN = {"Authorization": "Bearer admin-secret"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def deployment_server(tiny_checkpoint):
    port = _free_port()
    env = {**os.environ, "ELASTIC_HF_ADMIN_KEY": "admin-secret"}
    proc = subprocess.Popen(_cli() + ["serve", tiny_checkpoint, "--port", str(port), "--workers", "2",
                                      "--kv-cache-memory", "16MiB", "--max-model-len", "256",
                                      "--log-level", "warning"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        assert proc.poll() is None, f"server exited early: {proc.stdout.read()}"
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "deployment did not become healthy in 180 s"
        time.sleep(0.3)
    yield base
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


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
