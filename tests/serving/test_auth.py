"""One bearer-token rule for both keys: `bearer_token_matches` decides, and the /v1 API key (GuardMiddleware, on
the real server) and the admin key (`check_admin`) answer 401 exactly when it says no."""
from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from elastic_hf.serving.admin_morph import admin_morph_router
from elastic_hf.serving.auth import bearer_token_matches
from serving_helpers import API_KEY

ADMIN_KEY = "admin-secret"


@pytest.mark.parametrize("header, key, expected", [
    ("Bearer k", "k", True),
    ("bearer k", "k", True),           # the scheme is case-insensitive (RFC 7235)
    ("Bearer   k ", "k", True),        # blanks around the token are ignored
    ("Bearer wrong", "k", False),
    ("Bearer k2", "k", False),         # a longer token with the key as prefix is not the key
    ("Bearer ", "k", False),
    ("Basic k", "k", False),
    ("k", "k", False),
    ("", "k", False),
])
def test_bearer_token_matches(header, key, expected):
    assert bearer_token_matches(header, key) is expected


def _header_cases(key: str) -> list[dict]:
    return [{}, {"Authorization": f"Basic {key}"}, {"Authorization": f"Token {key}"},
            {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}x"},
            {"Authorization": f"Bearer {key}"}, {"Authorization": f"bearer {key}"},
            {"Authorization": f"Bearer   {key}"}]


def test_v1_401_follows_bearer_token_matches(tiny_server):
    for headers in _header_cases(API_KEY):
        allowed = bearer_token_matches(headers.get("Authorization", ""), API_KEY)
        resp = httpx.get(tiny_server.base_url + "/v1/models", headers=headers, timeout=30)
        if allowed:
            assert resp.status_code == 200, (headers, resp.text)
        else:
            assert resp.status_code == 401, (headers, resp.text)
            assert resp.json()["error"]["code"] == "invalid_api_key"
    assert sum(bearer_token_matches(h.get("Authorization", ""), API_KEY) for h in _header_cases(API_KEY)) == 3


def test_admin_401_follows_bearer_token_matches():
    app = FastAPI()
    # no morph manager: a caller past the key check gets 409 morph_off, which proves the check let it through
    app.include_router(admin_morph_router(object(), None, ADMIN_KEY))
    with TestClient(app) as client:
        for headers in _header_cases(ADMIN_KEY):
            allowed = bearer_token_matches(headers.get("Authorization", ""), ADMIN_KEY)
            resp = client.get("/admin/morph", headers=headers)
            error = resp.json()["error"]
            if allowed:
                assert (resp.status_code, error["code"]) == (409, "morph_off"), headers
            else:
                assert (resp.status_code, error["code"]) == (401, "invalid_admin_key"), headers
                assert error == {"message": "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                                 "type": "invalid_request_error", "param": None, "code": "invalid_admin_key"}
