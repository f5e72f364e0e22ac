"""The FastAPI app of `elastic-hf serve`: assembles the OpenAI-compatible routes (openai_routes.py), vLLM's utility
routes (utility_routes.py: /version, /ping, /tokenize, /detokenize), /health, /metrics, the error handlers
(errors.py) and the API-key / body-size guard (auth.py) over one AsyncEngine.

The app holds no engine state of its own; it translates HTTP to `AsyncEngine.add_requests` and outputs back to
OpenAI JSON / SSE. Every client error becomes an OpenAI-style error body and touches no other request.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.middleware.trustedhost import TrustedHostMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from elastic_hf import VERSION
from elastic_hf.engine.async_engine import AsyncEngine
from elastic_hf.serving.auth import GuardMiddleware
from elastic_hf.serving.errors import install_error_handlers
from elastic_hf.serving import protocol as p
from elastic_hf.serving.openapi_doc import document_request_bodies
from elastic_hf.serving.openai_routes import openai_router
from elastic_hf.serving.reasoning_parsers import reasoning_parser as make_reasoning_parser
from elastic_hf.serving.tool_parsers import tool_parser as make_tool_parser
from elastic_hf.serving.utility_routes import DetokenizeRequest, TokenizeRequest, utility_router

DEFAULT_MAX_BODY_BYTES = 1 << 20  # an 8k-token prompt is under 100 KB as text or as token ids


def system_fingerprint(model: str) -> str:
    """OpenAI's `system_fingerprint`: names the backend (engine version and model) so a client can tell when the
    server behind a name changed; stable across restarts of the same version on the same model."""
    return "fp_" + hashlib.sha256(f"elastic-hf {VERSION} {model}".encode()).hexdigest()[:10]


def build_app(async_engine: AsyncEngine, *, api_key: str | None = None,
              model_id: str | Sequence[str] | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              allowed_hosts: Sequence[str] | None = None, allowed_origins: Sequence[str] | None = None,
              enable_docs: bool = False, tool_parser: str | None = None,
              reasoning_parser: str | None = None) -> FastAPI:
    """The app serving `async_engine` as `model_id` (default: the engine's; several names: any of them, the
    first in /health and the metrics). With `api_key`, /v1 routes need `Authorization: Bearer <api_key>`; /health
    and /metrics stay open for probes and scrapers. allowed_hosts: the Host headers accepted (against DNS
    rebinding; None: any); allowed_origins: the browser origins CORS lets read responses (None: none);
    enable_docs: serve /docs, /redoc and /openapi.json (off: they are a map of the API for anyone); tool_parser:
    the tool-call parser that reads `tool_choice: "auto"` outputs (serving/tool_parsers.py; None: auto refused);
    reasoning_parser: moves a thinking model's <think> part to `reasoning_content` (serving/reasoning_parsers.py)."""
    names = (model_id,) if isinstance(model_id, str) else tuple(model_id or ()) or (async_engine.model_id,)
    model_id = names[0]
    docs = {} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="elastic-hf", description="OpenAI-compatible server over elastic-hf", version=VERSION,
                  **docs)
    app.state.async_engine = async_engine
    async_engine.metrics.set_model_name(model_id)   # vLLM's series name the served model: dashboards select by it
    install_error_handlers(app)

    @app.get("/health")
    async def health():
        # 503 while draining too, so load balancers stop sending requests while the ones in flight finish
        stats = async_engine.stats()
        status = "engine not running" if not async_engine.is_running else \
            "unhealthy: engine steps keep failing" if not async_engine.healthy else \
            "draining" if async_engine.draining else "ok"
        return JSONResponse({"status": status, "model": model_id, **stats},
                            status_code=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(async_engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(openai_router(async_engine, names=names, tokenizer=async_engine.tokenizer,
                                     max_model_len=async_engine.max_model_len,
                                     system_fingerprint=system_fingerprint(async_engine.model_id),
                                     tool_parser=make_tool_parser(tool_parser) if tool_parser else None,
                                     reasoning_parser=make_reasoning_parser(reasoning_parser)
                                     if reasoning_parser else None))
    app.include_router(utility_router(async_engine, names=names, max_model_len=async_engine.max_model_len))
    document_request_bodies(app, {"/v1/completions": p.CompletionRequest, "/v1/chat/completions":
                                  p.ChatCompletionRequest, "/tokenize": TokenizeRequest,
                                  "/detokenize": DetokenizeRequest}, names)
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    if allowed_hosts:   # outermost: a request for another host is refused before anything runs
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    return app
