"""FastAPI app: OpenAI-compatible routes over one AsyncEngine, plus /health and /metrics.

The app holds no engine state of its own; it translates HTTP to `AsyncEngine.add_request` and outputs back to
OpenAI JSON / SSE. Every client error becomes an OpenAI-style error body and touches no other request.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from elastic_hf.engine.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestStream
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.serving import protocol as p

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20  # an 8k-token prompt is under 100 KB as text or as token ids
MAX_CHOICES = 128  # n x prompts per HTTP request: one request must not flood the scheduler


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param, code=self.code)


def error_response(status: int, message: str, *, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


_KNOWN_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "n", "stop",
                 "stop_token_ids", "prompt", "messages")


def _value_error(exc: ValueError) -> APIError:
    message = str(exc)
    first = re.match(r"[A-Za-z_]*", message).group(0)  # engine messages start with the argument's name
    code = "context_length_exceeded" if "max_model_len" in message else None
    return APIError(400, message, param=first if first in _KNOWN_PARAMS else None, code=code)


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    problems = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        problems.append(f"{loc or 'body'}: {err.get('msg')}")
    first_loc = next((str(x) for x in exc.errors()[0].get("loc", ()) if x != "body"), None) if exc.errors() else None
    return APIError(400, "invalid request: " + "; ".join(problems[:8]), param=first_loc)


class GuardMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which would hide client disconnects from streaming responses):
    401 without the bearer key on /v1 routes; 413 for bodies over the limit, checked on Content-Length and again
    while a chunked body streams in, so an oversize upload is refused before it is buffered."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers", ()))
        if self.api_key and scope.get("path", "").startswith("/v1"):
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
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


def build_app(async_engine: AsyncEngine, *, api_key: str | None = None, model_id: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    model_id = model_id or async_engine.model_id
    max_model_len = async_engine.max_model_len
    tokenizer = async_engine.tokenizer
    app = FastAPI(title="elastic-hf", description="OpenAI-compatible server over elastic-hf")
    app.state.async_engine = async_engine

    # ------------------------------------------------------------ errors and auth
    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _req_validation(_req, exc: RequestValidationError):
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), code=str(exc.status_code))

    async def parse(request: Request, model: type[BaseModel]):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json")
        if not isinstance(data, dict):
            raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
        try:
            req = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc)
        if req.model != model_id:
            raise APIError(404, f"model {req.model!r} does not exist; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        unsupported = req.unsupported()
        if unsupported:
            raise APIError(400, f"not supported by this server: {', '.join(unsupported)}", param=unsupported[0],
                           code="unsupported_parameter")
        return req

    def check_max_tokens(max_tokens: int | None, name: str = "max_tokens") -> None:
        if max_tokens is None:
            return
        if max_tokens <= 0:
            raise APIError(400, f"{name} must be >= 1, got {max_tokens}", param=name)
        if max_tokens >= max_model_len:
            raise APIError(400, f"{name}={max_tokens} is beyond the limit: prompt tokens + {name} must fit "
                                f"max_model_len={max_model_len}", param=name)

    async def submit(prompts: list, params, prefix: str) -> list[RequestStream]:
        try:
            return await async_engine.add_requests(prompts, params,
                                                   [async_engine.new_request_id(prefix) for _ in prompts])
        except ValueError as exc:
            raise _value_error(exc)
        except EngineDeadError as exc:
            raise APIError(503, str(exc), type="server_error", code="engine_unavailable")
        except EngineError as exc:
            raise APIError(500, str(exc), type="server_error", code="engine_error")

    # ------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        stats = async_engine.stats()
        ok = async_engine.is_running
        return JSONResponse({"status": "ok" if ok else "engine not running", "model": model_id, **stats},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(async_engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return p.ModelList(data=[p.ModelCard(id=model_id, max_model_len=max_model_len)]).model_dump()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req: p.CompletionRequest = await parse(request, p.CompletionRequest)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        check_max_tokens(max_tokens)
        params = _params(req, max_tokens)
        prompts = req.prompts()
        if len(prompts) * params.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} = {len(prompts) * params.n} choices; "
                                f"at most {MAX_CHOICES} per request", param="n")
        streams = await submit(prompts, params, "cmpl")
        response_id = p.new_id("cmpl")
        if req.stream:
            return _EngineStreamingResponse(_completion_chunks(streams, req, response_id, model_id, params.n), streams)
        finals = await _collect(streams, request)
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            prefix = _echo_text(tokenizer, prompts[i]) if req.echo else ""
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                choices.append(p.CompletionChoice(index=i * params.n + o.index, text=prefix + o.text,
                                                  finish_reason=o.finish_reason))
        return p.CompletionResponse(id=response_id, model=model_id, choices=choices,
                                    usage=p.UsageInfo.of(prompt_tokens, completion_tokens)).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: p.ChatCompletionRequest = await parse(request, p.ChatCompletionRequest)
        requested = req.requested_max_tokens()
        check_max_tokens(requested, "max_completion_tokens" if req.max_completion_tokens is not None
                         else "max_tokens")
        try:
            prompt_ids = _chat_prompt_ids(tokenizer, req)
        except ValueError as exc:
            raise APIError(400, str(exc), param="messages")
        if len(prompt_ids) >= max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_model_len}",
                           param="messages", code="context_length_exceeded")
        # OpenAI's default for chat is "as many as fit"
        max_tokens = requested if requested is not None else max_model_len - len(prompt_ids)
        params = _params(req, max_tokens)
        if params.n > MAX_CHOICES:
            raise APIError(400, f"n={params.n} is beyond the limit of {MAX_CHOICES} choices per request", param="n")
        streams = await submit([prompt_ids], params, "chatcmpl")
        response_id = p.new_id("chatcmpl")
        if req.stream:
            return _EngineStreamingResponse(_chat_chunks(streams[0], req, response_id, model_id, params.n), streams)
        (out,) = await _collect(streams, request)
        choices = [p.ChatChoice(index=o.index, message=p.ChatMessageOut(content=o.text), finish_reason=o.finish_reason)
                   for o in out.outputs]
        usage = p.UsageInfo.of(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs))
        return p.ChatCompletionResponse(id=response_id, model=model_id, choices=choices, usage=usage).model_dump()

    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes)
    return app


# ---------------------------------------------------------------- helpers
def _params(req: p._SamplingRequest, max_tokens: int):
    try:
        return req.sampling_params(max_tokens)
    except ValueError as exc:
        raise _value_error(exc)


def _chat_prompt_ids(tokenizer, req: p.ChatCompletionRequest) -> list[int]:
    ids = tokenizer.apply_chat_template(req.template_messages(), add_generation_prompt=req.add_generation_prompt,
                                        tokenize=True, return_dict=False)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)


def _echo_text(tokenizer, prompt) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


async def _collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Final outputs of all streams; aborts them if the client disconnects before they finish."""
    async def drain(stream: RequestStream) -> RequestOutput:
        last = None
        async for out in stream:
            last = out
        return last

    work = asyncio.ensure_future(asyncio.gather(*(drain(s) for s in streams)))
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:  # client left: cancelling the drains aborts the requests in the engine
            work.cancel()
            for s in streams:
                s.abort()
            raise APIError(499, "client disconnected", code="client_closed_request")
        try:
            return work.result()
        except ValueError as exc:
            raise _value_error(exc)
        except EngineError as exc:
            raise APIError(500, str(exc), type="server_error", code="engine_error")
    finally:
        watch.cancel()
        if not work.done():
            work.cancel()


async def _wait_disconnect(request: Request) -> None:
    # After the body was read, the next ASGI message is http.disconnect, sent only when the client goes away.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams in arrival order; closing this generator aborts all unfinished ones."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done_marker = object()

    async def pump(i: int, stream: RequestStream):
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
            await queue.put((i, exc))
        finally:
            await queue.put((i, done_marker))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done_marker:
                remaining -= 1
            elif isinstance(item, BaseException):
                if isinstance(item, asyncio.CancelledError):
                    continue
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            s.abort()  # idempotent; frees blocks of any stream that did not finish


def _sse_data(obj) -> str:
    payload = obj.model_dump_json(exclude_none=False) if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {payload}\n\n"


def _sse_error(exc: Exception) -> str:
    status, kind = (500, "server_error")
    body = p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type=kind, code=str(status)))
    return f"data: {body.model_dump_json()}\n\n"


class _EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine requests however the response ends (done, disconnect, error):
    abort is idempotent, and a finished request ignores it."""

    def __init__(self, gen: AsyncIterator[str], streams: list[RequestStream]):
        super().__init__(gen, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._streams = streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self._streams:
                s.abort()
            try:
                await self.body_iterator.aclose()
            except (RuntimeError, asyncio.CancelledError):
                pass


async def _completion_chunks(streams, req: p.CompletionRequest, response_id: str, model_id: str, n: int):
    prompt_tokens: dict[int, int] = {}
    completion_tokens: dict[tuple[int, int], int] = {}
    try:
        async for i, out in _merge(streams):
            prompt_tokens[i] = len(out.prompt_token_ids)
            choices = []
            for o in out.outputs:
                completion_tokens[(i, o.index)] = len(o.token_ids)
                if o.delta_text or o.finish_reason is not None:
                    choices.append(p.CompletionChoice(index=i * n + o.index, text=o.delta_text,
                                                      finish_reason=o.finish_reason))
            if choices:
                yield _sse_data(p.CompletionChunk(id=response_id, model=model_id, choices=choices))
        if req.include_usage:
            usage = p.UsageInfo.of(sum(prompt_tokens.values()), sum(completion_tokens.values()))
            yield _sse_data(p.CompletionChunk(id=response_id, model=model_id, choices=[], usage=usage))
    except (EngineError, ValueError) as exc:
        yield _sse_error(exc)
    yield "data: [DONE]\n\n"


async def _chat_chunks(stream: RequestStream, req: p.ChatCompletionRequest, response_id: str, model_id: str,
                       n: int):
    def chunk(choices, usage=None):
        return _sse_data(p.ChatCompletionChunk(id=response_id, model=model_id, choices=choices, usage=usage))

    # OpenAI sends the role first, with empty content, once per choice
    yield chunk([p.ChatChunkChoice(index=k, delta=p.DeltaMessage(role="assistant", content="")) for k in range(n)])
    prompt_tokens, completion_tokens = 0, {}
    try:
        async for out in stream:
            prompt_tokens = len(out.prompt_token_ids)
            choices = []
            for o in out.outputs:
                completion_tokens[o.index] = len(o.token_ids)
                if o.delta_text or o.finish_reason is not None:
                    choices.append(p.ChatChunkChoice(index=o.index, delta=p.DeltaMessage(content=o.delta_text),
                                                     finish_reason=o.finish_reason))
            if choices:
                yield chunk(choices)
        if req.include_usage:
            yield chunk([], p.UsageInfo.of(prompt_tokens, sum(completion_tokens.values())))
    except (EngineError, ValueError) as exc:
        yield _sse_error(exc)
    yield "data: [DONE]\n\n"
