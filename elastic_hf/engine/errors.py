"""Errors the engine raises across its public surface. Callers map them to responses without parsing messages:
`InvalidRequest` carries the offending parameter and an OpenAI-style code (HTTP 400), `EngineError` is the engine's
own failure (HTTP 500, other requests continue), `EngineDeadError` a stopped engine (HTTP 503), `EngineOverloaded` a
full queue and `EngineDraining` a server shutting down (HTTP 503 with Retry-After), `RequestTimedOut` a request past
its time limit (HTTP 504)."""
from __future__ import annotations


class InvalidRequest(ValueError):
    """Bad input from a caller. A ValueError, so `except ValueError` keeps working in Python code.

    param: the request field at fault ("max_tokens", "prompt", "messages", ...), None when no single field is;
    code: a machine-readable reason such as "context_length_exceeded", None for a plain invalid value."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class EngineError(RuntimeError):
    """The engine failed while serving a request (not the caller's fault): HTTP 500, other requests continue."""


class EngineDeadError(EngineError):
    """The engine thread is not running (shut down, or never started)."""


class EngineOverloaded(EngineError):
    """Too many requests are queued already (EngineConfig.max_queued_requests): retry later. Nothing changed."""


class EngineDraining(EngineOverloaded):
    """Draining before a shutdown: no new request (an EngineOverloaded, so callers back off the same way)."""


class RequestTimedOut(EngineError):
    """The request ran past the engine's request timeout and was aborted (its KV blocks are free again)."""
