"""Who may call what, and how much they may send: the bearer-token check shared by the API key on /v1 routes
and the admin key on /admin routes, the pure-ASGI guard that enforces the API key and the body-size limit, and
the admin routes' body parsing."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from elastic_hf.serving.errors import error_response, validation_problems


def bearer_token_matches(header_value: str, key: str) -> bool:
    """True when an `Authorization` header value is `Bearer <key>` (scheme case-insensitive, blanks around the
    token ignored). Constant-time in the token, so response times do not reveal how much of a guess was right."""
    scheme, _, token = header_value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


# Routes the API key guards: the OpenAI API, and the utility routes that run the tokenizer and chat template on a
# caller's input (up to a whole request body of work each). /health, /metrics, /version and /ping stay open for
# probes and scrapers.
GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize")


class GuardMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would hide client disconnects from streaming responses):
    401 without the bearer key on the guarded routes; 413 for bodies over the limit, checked on Content-Length and again
    while a chunked body streams in, so an oversize upload is refused before it is buffered."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        if self.api_key and scope.get("path", "").startswith(GUARDED_PREFIXES):
            # HTTP header bytes are latin-1 by definition; Starlette's Request.headers decodes them the same way
            if not bearer_token_matches(headers.get(b"authorization", b"").decode("latin-1"), self.api_key):
                resp = error_response(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                return await resp(scope, receive, send)
        limit = self.max_body_bytes
        if not limit:
            return await self.app(scope, receive, send)
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self._reject(scope, receive, send, int(length))
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise _BodyTooLarge(seen)
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge as exc:
            await self._reject(scope, receive, send, exc.args[0])

    async def _reject(self, scope, receive, send, size: int):
        resp = error_response(413, f"request body has {size} bytes or more; the limit is {self.max_body_bytes} "
                                   f"bytes", code="request_too_large")
        await resp(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def check_admin(request: Request, admin_key: str | None) -> JSONResponse | None:
    """None when the caller may proceed; otherwise the error response. Without an admin key configured every
    admin call is refused: an endpoint that reshapes the deployment must not be open by accident."""
    if not admin_key:
        return error_response(403, "admin endpoints are disabled: start the server with --admin-key",
                              code="admin_disabled")
    if not bearer_token_matches(request.headers.get("authorization", ""), admin_key):
        return error_response(401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                              code="invalid_admin_key")
    return None


async def parse_admin_body(request: Request, model: type[BaseModel], what: str):
    """(body, None) or (None, 400 response naming every invalid field)."""
    try:
        return model.model_validate_json(await request.body()), None
    except ValidationError as exc:
        return None, error_response(400, f"invalid {what} request: {validation_problems(exc)}",
                                    code="invalid_request")


async def admin_request(request: Request, admin_key: str | None, model: type[BaseModel], what: str,
                        empty_means_defaults: bool = False):
    """An admin POST's key check and body: (body, None), or (None, the 401/403/400 response). With
    empty_means_defaults an empty body (curl -X POST without -d) is the schema's defaults."""
    denied = check_admin(request, admin_key)
    if denied is not None:
        return None, denied
    if empty_means_defaults and not (await request.body()).strip():
        return model(), None
    return await parse_admin_body(request, model, what)
