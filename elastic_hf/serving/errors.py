"""Every error the HTTP server answers with: the one OpenAI-style body (`{"error": {message, type, param, code}}`)
as a JSON response or as an SSE event, the `APIError` the routes raise, the mapping of engine and pydantic
errors to it, and the FastAPI exception handlers that turn them into responses.

Engine errors are mapped by type and by the attributes they carry (`InvalidRequest.param` / `.code`), never by
reading their message: the message is for people and may change wording freely."""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from elastic_hf.engine.errors import (EngineDeadError, EngineDraining, EngineError, EngineOverloaded, InvalidRequest,
                                      RequestTimedOut)
from elastic_hf.serving import protocol as p


def _body(message: str, *, type: str, param: str | None, code: str | None) -> p.ErrorResponse:
    return p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))


def error_response(status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    """The OpenAI-style error body with its HTTP status: the only way any route or middleware answers an error."""
    return JSONResponse(_body(message, type=type, param=param, code=code).model_dump(), status_code=status)


def sse_error_event(exc: BaseException) -> str:
    """The error event of a stream that already sent its 200 status: the same body as `error_response`, as one
    SSE `data:` line. It is always a server error: input errors are refused before the stream starts. A stream
    the server ends on purpose (request timeout, shutdown) carries the code of that cause, any other failure 500."""
    on_purpose = isinstance(exc, (RequestTimedOut, EngineDeadError))
    code = api_error_from_engine(exc).code if on_purpose else "500"
    return f"data: {_body(str(exc), type='server_error', param=None, code=code).model_dump_json()}\n\n"


OVERLOAD_RETRY_AFTER_S = 1   # what a client told to back off by a full queue waits before retrying
# A draining server does not come back, but a client behind a load balancer reaches another replica on its retry,
# and the balancer takes a server out within seconds of its /health turning 503.
DRAIN_RETRY_AFTER_S = 1


class APIError(Exception):
    """Raised anywhere under a route; the handler `install_error_handlers` installs answers it with its body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        response = error_response(self.status, self.message, type=self.type, param=self.param, code=self.code)
        response.headers.update(self.headers)
        return response


def validation_problems(exc: ValidationError | RequestValidationError) -> str:
    """'field.path: what is wrong' for the first 8 problems, joined by '; ' (a body can have hundreds)."""
    problems = []
    for err in exc.errors()[:8]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        problems.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(problems)


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """400 for a request body that does not fit its pydantic model; param is the first field at fault."""
    errors = exc.errors()
    first_loc = next((str(x) for x in errors[0].get("loc", ()) if x != "body"), None) if errors else None
    return APIError(400, "invalid request: " + validation_problems(exc), param=first_loc)


def api_error_from_engine(exc: ValueError | EngineError) -> APIError:
    """The HTTP answer to an error from the engine (`AsyncEngine.add_requests`, a request stream, or
    `SamplingParams`): bad input is a 400 naming the field the engine blames, a stopped, full or draining engine a
    503, a request past its timeout a 504, any other engine failure a 500."""
    if isinstance(exc, InvalidRequest):
        return APIError(400, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, ValueError):  # bad input the engine did not attribute to one field
        return APIError(400, str(exc))
    if isinstance(exc, EngineDraining):
        return APIError(503, str(exc), type="server_error", code="server_draining",
                        headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
    if isinstance(exc, RequestTimedOut):
        return APIError(504, str(exc), type="server_error", code="request_timeout")
    if isinstance(exc, EngineOverloaded):
        return APIError(503, str(exc), type="server_error", code="server_overloaded",
                        headers={"Retry-After": str(OVERLOAD_RETRY_AFTER_S)})
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_unavailable")
    return APIError(500, str(exc), type="server_error", code="engine_error")  # EngineError


def install_error_handlers(app: FastAPI) -> None:
    """Make every error the app raises (ours, FastAPI's validation, Starlette's 404/405) an OpenAI-style body."""

    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_req, exc: RequestValidationError):
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), code=str(exc.status_code))
