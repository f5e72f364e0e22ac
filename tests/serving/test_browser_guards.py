"""What a browser can do to a server on localhost: with --allowed-hosts a request for another Host (a DNS
rebinding page) is refused; CORS lets only --allowed-origins read responses; /docs, /redoc and /openapi.json are
off unless --enable-docs, and then the OpenAPI document describes every request body (what fuzzers and client
generators read)."""
from __future__ import annotations

import httpx
import pytest

from serving_helpers import tiny_model_server


@pytest.fixture(scope="module")
def guarded_server(serving_checkpoint):
    with tiny_model_server(serving_checkpoint, allowed_hosts=["127.0.0.1", "localhost"],
                           allowed_origins=["https://app.example.com"], enable_docs=True) as handle:
        yield handle


def test_other_hosts_are_refused_and_cors_names_only_allowed_origins(guarded_server):
    base = guarded_server.base_url
    assert httpx.get(base + "/health").status_code == 200
    assert httpx.get(base + "/health", headers={"Host": "attacker.example"}).status_code == 400
    allowed = httpx.options(base + "/v1/completions", headers={
        "Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"})
    assert allowed.headers.get("access-control-allow-origin") == "https://app.example.com"
    other = httpx.get(base + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_openapi_document_describes_every_request_body(guarded_server):
    doc = httpx.get(guarded_server.base_url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, model in (("/v1/completions", "CompletionRequest"), ("/v1/chat/completions", "ChatCompletionRequest"),
                        ("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}
    assert {"model", "messages", "temperature", "max_tokens"} <= set(schemas["ChatCompletionRequest"]["properties"])
    assert "prompt" in schemas["CompletionRequest"]["required"]


def test_docs_are_off_by_default(tiny_server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(tiny_server.base_url + path).status_code == 404
