"""Admin morph routes on a live AsyncEngine: auth, clear 4xx for bad input, forced morphs while requests
stream, and the morph metrics on /metrics."""
from __future__ import annotations

import concurrent.futures

import pytest
from fastapi.testclient import TestClient

ADMIN_KEY = "admin-secret"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def admin(serving_checkpoint):
    from elastic_hf.engine.async_engine import AsyncEngine
    from elastic_hf import ElasticModel
    from elastic_hf.serving.admin_morph import admin_morph_router
    from elastic_hf.serving.app import build_app

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=512, kv_cache_memory=4 << 20,
                                         morph="manual", morph_options={"use_cache": False})
    async_engine = AsyncEngine(model.engine).start()
    app = build_app(async_engine, model_id=model.model_id)
    app.include_router(admin_morph_router(model, async_engine, ADMIN_KEY))
    with TestClient(app) as client:
        yield client, model
    async_engine.shutdown()


def test_missing_or_wrong_admin_key_is_401(admin):
    client, _ = admin
    assert client.get("/admin/morph").status_code == 401
    response = client.post("/admin/morph", json={"layers": "all", "precision": "w4"},
                           headers={"Authorization": "Bearer nope"})
    assert response.status_code == 401 and "admin key" in response.json()["error"]["message"]


def test_no_admin_key_configured_is_403(serving_checkpoint):
    from fastapi import FastAPI

    from elastic_hf.serving.admin_morph import admin_morph_router

    app = FastAPI()
    app.include_router(admin_morph_router(object(), None, None))
    with TestClient(app) as client:
        response = client.get("/admin/morph", headers=AUTH)
    assert response.status_code == 403 and "--admin-key" in response.json()["error"]["message"]


@pytest.mark.parametrize("body, status, needle", [
    ({"layers": [0], "precision": "int3"}, 400, "precision 'int3' is unknown; allowed: fp, w8, w4"),
    ({"layers": [5], "precision": "w4"}, 404, "layer(s) [5] do not exist: this model has layers 0..2"),
    ({"layers": [0]}, 400, "'precision' is required"),
    ({"precision": "w4", "layers": "some"}, 400, "invalid morph request"),
    ({"controller": "on"}, 400, "has no automatic controller"),
    ({}, 400, "give 'precision' and 'layers'"),
])
def test_bad_input_gets_a_clear_4xx(admin, body, status, needle):
    client, _ = admin
    response = client.post("/admin/morph", json=body, headers=AUTH)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]["message"]


def test_forced_morph_while_requests_stream(admin):
    client, model = admin
    params = {"model": model.model_id, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0.0,
              "ignore_eos": True}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.post, "/v1/completions", json=params) for _ in range(4)]
        state = client.post("/admin/morph", json={"layers": "all", "precision": "w4"}, headers=AUTH).json()
        assert state["layer_counts"]["w4"] == 3 and state["controller_enabled"] is False
        responses = [f.result() for f in futures]
    for response in responses:
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 48
    got = client.get("/admin/morph", headers=AUTH).json()
    assert [layer["precision"] for layer in got["layers"]] == ["w4", "w4", "w4"]
    assert got["kv_blocks_total"] > 0 and got["swaps"]["fp->w4"] == 3 and got["swap_latency_s_mean"] > 0
    metrics = client.get("/metrics").text
    assert 'elastic_hf_morph_layers{precision="w4",worker="0"} 3.0' in metrics
    assert "elastic_hf_morph_swap_latency_seconds_count" in metrics
    back = client.post("/admin/morph", json={"layers": [0, 1, 2], "precision": "fp"}, headers=AUTH).json()
    assert back["layer_counts"]["fp"] == 3 and back["pending"] == []


def test_idle_server_restores_to_full_precision_by_itself(serving_checkpoint):
    """No requests at all: the engine thread keeps ticking step boundaries while layers are below fp
    (LLMEngine.idle_work_checks), so the controller restores them once its hold time passed."""
    import time

    from elastic_hf.engine.async_engine import AsyncEngine
    from elastic_hf import ElasticModel
    from elastic_hf.serving.admin_morph import admin_morph_router
    from elastic_hf.serving.app import build_app

    model = ElasticModel.from_pretrained(
        serving_checkpoint, max_model_len=512, kv_cache_memory=4 << 20, morph="default",
        morph_options={"use_cache": False,
                       "controller": {"restore_persistence_steps": 2, "restore_hold_s": 0.2,
                                      "restore_layers_per_step": 1}})
    async_engine = AsyncEngine(model.engine).start()
    app = build_app(async_engine, model_id=model.model_id)
    app.include_router(admin_morph_router(model, async_engine, ADMIN_KEY))
    try:
        with TestClient(app) as client:
            state = client.post("/admin/morph", json={"layers": "all", "precision": "w4", "controller": "on"},
                                headers=AUTH).json()
            assert state["layer_counts"]["w4"] == 3 and state["controller_enabled"] is True
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = client.get("/admin/morph", headers=AUTH).json()
                if state["layer_counts"]["fp"] == 3:
                    break
                time.sleep(0.05)
            assert state["layer_counts"]["fp"] == 3, state["layer_counts"]
            assert state["swaps"]["w4->fp"] == 3
    finally:
        async_engine.shutdown()
