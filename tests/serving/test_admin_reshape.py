"""`elastic-hf serve --workers 2 --morph default`: a real two-process deployment behind the HTTP server. Under a load
that exhausts the KV caches the workers morph their own layers to W4 (the controller, not a forced call); POST
/admin/reshape then merges the two TP1 instances into one TP2 instance (bringing the layers back to full precision
first) and splits them back, and the server answers the same greedy text as before the load; /admin/morph and
/admin/reshape live on the same server."""
import concurrent.futures
import os
import time

import httpx
import pytest

from test_cli import start_cli_server, stop_cli_server

ADMIN = {"Authorization": "Bearer admin-secret"}
PROMPTS = ["The quick brown fox", "Once upon a time, in a land far away,"]
LOAD_PROMPT = "The history of the Roman Empire spans more than a thousand years, from the founding of the city"


@pytest.fixture(scope="module")
def deployment_server(serving_checkpoint):
    env = {**os.environ, "ELASTIC_HF_ADMIN_KEY": "admin-secret"}
    # 256 KiB of KV per worker: 21 blocks of 16 tokens, so a handful of long requests exhausts a TP1 instance.
    proc, base = start_cli_server([serving_checkpoint, "--workers", "2", "--morph", "default", "--kv-cache-memory",
                                   "256KiB", "--max-model-len", "256", "--log-level", "warning"], env)
    yield base
    stop_cli_server(proc)


def _model(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def _complete(base: str, prompt: str, max_tokens: int = 12) -> dict:
    resp = httpx.post(base + "/v1/completions", timeout=300,
                      json={"model": _model(base), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _answers(base: str) -> list[str]:
    return [_complete(base, p)["choices"][0]["text"] for p in PROMPTS]


def _morph_state(base: str, instance: int) -> httpx.Response:
    return httpx.get(base + "/admin/morph", params={"instance": instance}, headers=ADMIN, timeout=30)


def test_serve_two_workers_morphs_under_load_reshapes_and_answers_exactly(deployment_server):
    base = deployment_server
    before = _answers(base)

    # Load: 8 long requests at once, more than both KV caches hold at full precision.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_complete, base, LOAD_PROMPT, 100) for _ in range(8)]
        morphed = 0
        while not all(f.done() for f in futures):
            morphed = max(morphed, sum(_morph_state(base, i).json()["swaps"].get("fp->w4", 0) for i in (0, 1)))
            time.sleep(0.05)
        results = [f.result() for f in futures]
    assert all(r["usage"]["completion_tokens"] == 100 for r in results)
    swaps = [_morph_state(base, i).json()["swaps"] for i in (0, 1)]
    assert max(morphed, sum(s.get("fp->w4", 0) for s in swaps)) >= 1, swaps   # the controller morphed under load

    assert httpx.post(base + "/admin/reshape", json={"topology": [2]}, timeout=30).status_code == 401
    bad = httpx.post(base + "/admin/reshape", json={"topology": [3]}, headers=ADMIN, timeout=30)
    assert bad.status_code == 400 and "not a candidate" in bad.json()["error"]["message"]

    merged = httpx.post(base + "/admin/reshape", json={"topology": [2]}, headers=ADMIN, timeout=120)
    assert merged.status_code == 200, merged.text
    assert merged.json()["committed"] and merged.json()["new"] == "[2]"
    assert httpx.get(base + "/admin/reshape", headers=ADMIN, timeout=10).json()["topology"] == [2]
    tp2 = _morph_state(base, 0)
    assert tp2.status_code == 409 and tp2.json()["error"]["code"] == "instance_not_tp1"
    assert _answers(base) == before  # TP2 at full precision gives the TP1 tokens

    split = httpx.post(base + "/admin/reshape", json={"topology": [1, 1]}, headers=ADMIN, timeout=120)
    assert split.status_code == 200 and split.json()["new"] == "[1,1]"
    assert _answers(base) == before
    states = [_morph_state(base, i).json() for i in (0, 1)]
    assert [s["worker"] for s in states] == [0, 1] and all(s["layer_counts"]["fp"] == 3 for s in states)
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert 'elastic_hf_reshapes_total{outcome="committed"} 2.0' in metrics
    assert 'elastic_hf_morph_layers{precision="fp",worker="1"} 3.0' in metrics


def test_morph_route_rejects_an_unknown_instance(deployment_server):
    response = _morph_state(deployment_server, 5)
    assert response.status_code == 404 and "instances 0..1" in response.json()["error"]["message"]


def test_pipeline_reshape_over_http_answers_exactly(deployment_server):
    """POST /admin/reshape to a two-stage pipeline (and an uneven split), GET /admin/topology shows the stages,
    bad topologies are 400s naming what is allowed, and the answers stay the same."""
    base = deployment_server
    before = _answers(base)
    for bad, message in ((["1x2:3/0"], "no empty stage"), (["1x4"], "not a candidate"), ("2y2", "TPxPP"),
                         (["1x2:1/1"], "covers 2 layers")):
        response = httpx.post(base + "/admin/reshape", json={"topology": bad}, headers=ADMIN, timeout=30)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text
    piped = httpx.post(base + "/admin/reshape", json={"topology": "1x2:1/2"}, headers=ADMIN, timeout=120)
    assert piped.status_code == 200 and piped.json()["new"] == "[1x2:1/2]", piped.text
    layout = httpx.get(base + "/admin/topology", headers=ADMIN, timeout=10).json()
    assert layout["topology"] == ["1x2:1/2"] and layout["instances"][0]["pp"] == 2
    assert [s["layers"] for s in layout["instances"][0]["stages"]] == [[0, 1], [1, 3]]
    assert _answers(base) == before
    assert httpx.post(base + "/admin/reshape", json={"topology": [1, 1]}, headers=ADMIN,
                      timeout=120).status_code == 200
    assert httpx.get(base + "/admin/topology", headers=ADMIN, timeout=10).json()["text"] == "[1,1]"
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert 'elastic_hf_instances{pp="2",tp="1"} 0.0' in metrics and 'elastic_hf_instances{pp="1",tp="1"} 2.0' in metrics
