"""From engine request streams to HTTP bodies: Server-Sent Events for `stream: true` (the completion and chat
chunk generators, the response that aborts its engine requests however it ends) and the final outputs for
non-streaming requests (aborted when the client goes away). Every path that stops reading a stream early
aborts its request, so a client that leaves never keeps KV blocks busy."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from elastic_hf.engine.request_stream import RequestStream
from elastic_hf.engine.errors import EngineError
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.serving import protocol as p
from elastic_hf.serving.errors import APIError, api_error_from_engine, sse_error_event
from elastic_hf.serving.logprobs_format import LogprobFormatter
from elastic_hf.serving.reasoning_parsers import ReasoningParser, ReasoningStream
from elastic_hf.serving.tool_calls import ToolCallStream, ToolPlan

SSE_DONE = "data: [DONE]\n\n"


async def collect(streams: list[RequestStream], request: Request) -> list[RequestOutput]:
    """Final outputs of all streams; aborts them if the client disconnects before they finish (HTTP 499)."""
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
        except (ValueError, EngineError) as exc:
            raise api_error_from_engine(exc) from exc
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


class EngineStreamingResponse(StreamingResponse):
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


@dataclass(slots=True)
class ResponseContext:
    """What every object of one response shares: one id, one `created` stamp, the model name and fingerprint; and
    for streams, which usage the client asked for and how token log-probabilities are rendered."""
    id: str
    model: str
    system_fingerprint: str | None
    formatter: LogprobFormatter
    created: int = field(default_factory=p.now)
    include_usage: bool = False      # a last chunk with the usage; every other chunk carries usage: null
    continuous_usage: bool = False   # the usage so far on every chunk

    def common(self) -> dict:
        return {"id": self.id, "model": self.model, "created": self.created,
                "system_fingerprint": self.system_fingerprint}

    def sse(self, chunk: BaseModel) -> str:
        # OpenAI sends the usage field only when the client asked for usage (stream_options)
        asked = self.include_usage or self.continuous_usage
        return f"data: {chunk.model_dump_json(exclude=None if asked else {'usage'})}\n\n"


async def completion_chunks(streams: list[RequestStream], ctx: ResponseContext, n: int,
                            logprobs: bool) -> AsyncIterator[str]:
    """SSE events of /v1/completions: choice index = prompt index * n + the choice's index within its prompt."""
    prompt_tokens: dict[int, tuple[int, int]] = {}   # prompt index -> (prompt tokens, of them cached)
    completion_tokens: dict[tuple[int, int], int] = {}
    text_offsets: dict[tuple[int, int], int] = {}   # characters of each choice's tokens sent so far
    try:
        async for i, out in _merge(streams):
            prompt_tokens[i] = (len(out.prompt_token_ids), out.num_cached_tokens)
            choices = []
            for o in out.outputs:
                key = (i, o.index)
                completion_tokens[key] = completion_tokens.get(key, 0) + len(o.delta_token_ids)
                lp = None
                if logprobs and o.delta_logprobs:
                    lp = ctx.formatter.completion(o.delta_logprobs, text_offsets.get(key, 0))
                    text_offsets[key] = lp.text_offset[-1] + len(lp.tokens[-1])
                if o.delta_text or o.finish_reason is not None or lp is not None:
                    choices.append(p.CompletionChoice(index=i * n + o.index, text=o.delta_text, logprobs=lp,
                                                      finish_reason=o.finish_reason))
            if choices:
                usage = _usage(prompt_tokens, completion_tokens) if ctx.continuous_usage else None
                yield ctx.sse(p.CompletionChunk(**ctx.common(), choices=choices, usage=usage))
        if ctx.include_usage:
            yield ctx.sse(p.CompletionChunk(**ctx.common(), choices=[], usage=_usage(prompt_tokens, completion_tokens)))
    except (EngineError, ValueError) as exc:
        yield sse_error_event(exc)
    yield SSE_DONE


class ChoiceDeltas:
    """One chat choice's text deltas as OpenAI delta messages: reasoning split off first (a reasoning parser), then
    the rest as content or tool-call deltas (a tool plan)."""

    def __init__(self, plan: ToolPlan | None, reasoning: ReasoningParser | None):
        self.tools = ToolCallStream(plan) if plan is not None and plan.mode != "none" else None
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None

    def delta(self, text: str, finish_reason: str | None) -> tuple[p.DeltaMessage, str | None]:
        finished = finish_reason is not None
        thought = None
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, finished)
            text = text or ""
        if self.tools is None:
            return p.DeltaMessage(content=text or None, reasoning_content=thought), finish_reason
        content, calls = self.tools.feed(text, finished)
        if finish_reason == "stop" and self.tools.made_calls and self.tools.plan.mode in ("auto", "required"):
            finish_reason = "tool_calls"
        return p.DeltaMessage(content=content, reasoning_content=thought, tool_calls=calls or None), finish_reason


async def chat_chunks(stream: RequestStream, ctx: ResponseContext, n: int, logprobs: bool,
                      plan: ToolPlan | None = None, reasoning: ReasoningParser | None = None) -> AsyncIterator[str]:
    """SSE events of /v1/chat/completions: a role-only chunk per choice first, as OpenAI sends; each choice's text
    then goes out as reasoning, content or tool-call deltas (ChoiceDeltas)."""
    prompt_tokens: dict[int, tuple[int, int]] = {0: (0, 0)}   # (prompt tokens, of them cached)
    completion_tokens: dict[tuple[int, int], int] = {}
    deltas = {k: ChoiceDeltas(plan, reasoning) for k in range(n)}

    def chunk(choices, usage=None):
        if usage is None and ctx.continuous_usage:
            usage = _usage(prompt_tokens, completion_tokens)
        return ctx.sse(p.ChatCompletionChunk(**ctx.common(), choices=choices, usage=usage))

    # OpenAI sends the role first, with empty content, once per choice
    yield chunk([p.ChatChunkChoice(index=k, delta=p.DeltaMessage(role="assistant", content="")) for k in range(n)])
    try:
        async for out in stream:
            prompt_tokens[0] = (len(out.prompt_token_ids), out.num_cached_tokens)
            choices = []
            for o in out.outputs:
                key = (0, o.index)
                completion_tokens[key] = completion_tokens.get(key, 0) + len(o.delta_token_ids)
                lp = ctx.formatter.chat(o.delta_logprobs) if logprobs and o.delta_logprobs else None
                delta, finish_reason = deltas[o.index].delta(o.delta_text, o.finish_reason)
                if delta.content or delta.reasoning_content or delta.tool_calls or finish_reason is not None \
                        or lp is not None:
                    choices.append(p.ChatChunkChoice(index=o.index, delta=delta, logprobs=lp,
                                                     finish_reason=finish_reason))
            if choices:
                yield chunk(choices)
        if ctx.include_usage:
            yield chunk([], _usage(prompt_tokens, completion_tokens))
    except (EngineError, ValueError) as exc:
        yield sse_error_event(exc)
    yield SSE_DONE


def _usage(prompt_tokens: dict, completion_tokens: dict) -> p.UsageInfo:
    return p.UsageInfo.of(sum(n for n, _ in prompt_tokens.values()), sum(completion_tokens.values()),
                          sum(cached for _, cached in prompt_tokens.values()))
