"""The admin key check shared by every /admin route, and the OpenAI-style error body they answer with."""
from __future__ import annotations

import hmac

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError


def admin_error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": code}}, status_code=status)


def check_admin(request: Request, admin_key: str | None) -> JSONResponse | None:
    """None when the caller may proceed; otherwise the error response. Without an admin key configured every
    admin call is refused: an endpoint that reshapes the deployment must not be open by accident."""
    if not admin_key:
        return admin_error(403, "admin endpoints are disabled: start the server with --admin-key", "admin_disabled")
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), admin_key.encode()):
        return admin_error(401, "missing or invalid admin key: send 'Authorization: Bearer <admin key>'",
                           "invalid_admin_key")
    return None


async def parse_admin_body(request: Request, model: type[BaseModel], what: str):
    """(body, None) or (None, 400 response naming every invalid field)."""
    try:
        return model.model_validate_json(await request.body()), None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()[:8])
        return None, admin_error(400, f"invalid {what} request: {problems}", "invalid_request")
