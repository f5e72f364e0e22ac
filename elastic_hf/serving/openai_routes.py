"""The OpenAI-compatible routes (/v1/models, /v1/completions, /v1/chat/completions) over one AsyncEngine, and
the request checks only HTTP needs: body parsing, the served model's name, choice and max_tokens limits, chat
templates. Value ranges of sampling options are checked by `SamplingParams` and the engine, so the HTTP and the
Python API give the same messages."""
from __future__ import annotations

import json
import logging

from fastapi import APIRouter, Request
from pydantic import ValidationError

from elastic_hf.engine.async_engine import AsyncEngine
from elastic_hf.engine.request_stream import RequestStream
from elastic_hf.engine.errors import EngineError
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.serving import protocol as p
from elastic_hf.serving.errors import APIError, api_error_from_engine, validation_error
from elastic_hf.serving.logprobs_format import LogprobFormatter, joined
from elastic_hf.serving.model_cards import ModelCard, ModelList
from elastic_hf.serving.streaming import (EngineStreamingResponse, ResponseContext, chat_chunks, collect,
                                          completion_chunks)
from elastic_hf.serving.tool_calls import final_message, plan_tools
from elastic_hf.serving.reasoning_parsers import ReasoningParser
from elastic_hf.serving.tool_parsers import ToolParser

log = logging.getLogger(__name__)
MAX_CHOICES = 128  # n x prompts per HTTP request: one request must not flood the scheduler
_logged_unknown_fields: set[str] = set()


async def parse(request: Request, model: type[p.SamplingRequest], names: tuple[str, ...]) -> p.SamplingRequest:
    """The body as `model`, for the served model, without unsupported options; APIError otherwise."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json")
    except RecursionError:   # JSON nested deeper than Python's parser recurses (a 1 MiB body can nest 500k deep)
        raise APIError(400, "request body is not valid JSON: it nests too deeply", code="invalid_json")
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        req = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc)
    if req.model not in names:
        raise APIError(404, f"model {req.model!r} does not exist; this server serves {' or '.join(map(repr, names))}",
                       param="model", code="model_not_found")
    unsupported = req.unsupported()
    if unsupported:
        raise APIError(400, f"not supported by this server: {', '.join(unsupported)}", param=unsupported[0],
                       code="unsupported_parameter")
    new_unknown = [name for name in req.unknown_fields() if name not in _logged_unknown_fields]
    if new_unknown:   # once per field name, as vLLM does: a client sending them on every request floods no log
        _logged_unknown_fields.update(new_unknown)
        log.warning("requests contain fields this server does not know, which are ignored: %s", ", ".join(new_unknown))
    return req


def check_max_tokens(max_tokens: int | None, max_model_len: int, name: str = "max_tokens") -> None:
    """Refuse a max_tokens that no prompt could satisfy before tokenizing anything; `name` is the field the
    client used (chat accepts max_completion_tokens too)."""
    if max_tokens is None:
        return
    if max_tokens <= 0:
        raise APIError(400, f"{name} must be >= 1, got {max_tokens}", param=name)
    if max_tokens >= max_model_len:
        raise APIError(400, f"{name}={max_tokens} is beyond the limit: prompt tokens + {name} must fit "
                            f"max_model_len={max_model_len}", param=name)


def request_checked(fn, *args):
    """fn(*args), with a ValueError (InvalidRequest: a field the request got wrong) as its 400."""
    try:
        return fn(*args)
    except ValueError as exc:
        raise api_error_from_engine(exc) from exc


def echo_text(tokenizer, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt)


def openai_router(async_engine: AsyncEngine, *, names: tuple[str, ...], tokenizer, max_model_len: int,
                  system_fingerprint: str | None = None, tool_parser: ToolParser | None = None,
                  reasoning_parser: ReasoningParser | None = None) -> APIRouter:
    """The /v1 routes serving `async_engine` under `names` (vLLM's --served-model-name: any of them in a request's
    'model', which its response echoes). Errors are raised as APIError: the app
    needs `errors.install_error_handlers` for them to become OpenAI-style bodies. `system_fingerprint` names the
    backend configuration in every response (OpenAI's field; clients compare it to tell deployments apart).
    tool_parser: how `tool_choice: "auto"` outputs are read (vLLM's --enable-auto-tool-choice with
    --tool-call-parser); None: auto tool choice is refused. reasoning_parser: splits a thinking model's reasoning
    from its answer (vLLM's --reasoning-parser)."""
    router = APIRouter()
    formatter = LogprobFormatter(tokenizer)

    def context(prefix: str, req: p.SamplingRequest) -> ResponseContext:
        return ResponseContext(p.new_id(prefix), req.model, system_fingerprint, formatter,
                               include_usage=req.include_usage, continuous_usage=req.continuous_usage)

    async def submit(prompts: list, params: SamplingParams, response_id: str) -> list[RequestStream]:
        """The engine's request ids are the response's id (vLLM's too), `{id}-{i}` for a list of prompts, so the
        server's logs and timeline (engine/timeline.py) name what the client saw."""
        ids = [response_id] if len(prompts) == 1 else [f"{response_id}-{i}" for i in range(len(prompts))]
        try:
            return await async_engine.add_requests(prompts, params, ids)
        except (ValueError, EngineError) as exc:
            raise api_error_from_engine(exc) from exc

    @router.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=name, root=async_engine.model_id, max_model_len=max_model_len)
                                 for name in names]).model_dump()

    @router.post("/v1/completions")
    async def completions(request: Request):
        req: p.CompletionRequest = await parse(request, p.CompletionRequest, names)
        defaults = async_engine.default_sampling
        max_tokens = defaults.get("max_tokens", 16) if req.max_tokens is None else req.max_tokens
        check_max_tokens(max_tokens, max_model_len)
        params = request_checked(req.sampling_params, max_tokens, defaults, request_checked(req.constraint))
        prompts = req.prompts()
        if len(prompts) * params.n > MAX_CHOICES:
            raise APIError(400, f"{len(prompts)} prompts x n={params.n} = {len(prompts) * params.n} choices; "
                                f"at most {MAX_CHOICES} per request", param="n")
        ctx = context("cmpl", req)
        streams = await submit(prompts, params, ctx.id)
        wants_logprobs = params.logprobs is not None
        if req.stream:
            return EngineStreamingResponse(completion_chunks(streams, ctx, params.n, wants_logprobs), streams)
        finals = await collect(streams, request)
        choices, prompt_tokens, completion_tokens, cached_tokens = [], 0, 0, 0
        for i, out in enumerate(finals):
            prompt_tokens += len(out.prompt_token_ids)
            cached_tokens += out.num_cached_tokens
            prefix = echo_text(tokenizer, prompts[i]) if req.echo else ""
            for o in out.outputs:
                completion_tokens += len(o.token_ids)
                logprobs = None
                if wants_logprobs and req.echo:   # the echoed prompt's tokens first, then the completion's
                    logprobs = joined(formatter.echoed_prompt(out.prompt_token_ids, out.prompt_logprobs),
                                      formatter.completion(o.logprobs))
                elif wants_logprobs:
                    logprobs = formatter.completion(o.logprobs)
                choices.append(p.CompletionChoice(index=i * params.n + o.index, text=prefix + o.text,
                                                  logprobs=logprobs, finish_reason=o.finish_reason))
        return p.CompletionResponse(**ctx.common(), choices=choices,
                                    usage=p.UsageInfo.of(prompt_tokens, completion_tokens, cached_tokens)).model_dump()

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req: p.ChatCompletionRequest = await parse(request, p.ChatCompletionRequest, names)
        requested = req.requested_max_tokens()
        check_max_tokens(requested, max_model_len,
                         "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
        plan = request_checked(plan_tools, req, tool_parser)
        constraint = plan.constraint or request_checked(req.constraint)
        template_kwargs = request_checked(req.template_kwargs)
        try:   # on the input thread, as every request's tokenization (engine/input_processor.py)
            prompt_ids = await async_engine.on_input_thread(
                lambda: async_engine.input_processor.render_chat(req.template_messages(), req.add_generation_prompt,
                                                                 tools=req.template_tools(),
                                                                 template_kwargs=template_kwargs))
        except ValueError as exc:  # the conversation as a whole is at fault, whichever part of it
            raise APIError(400, str(exc), param="messages")
        if len(prompt_ids) >= max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_model_len}",
                           param="messages", code="context_length_exceeded")
        # OpenAI's default for chat is "as many as fit", capped by the model's generation config (as vLLM does)
        defaults = async_engine.default_sampling
        fit = max_model_len - len(prompt_ids)
        max_tokens = requested if requested is not None else min(fit, defaults.get("max_tokens", fit))
        params = request_checked(req.sampling_params, max_tokens, defaults, constraint)
        if params.n > MAX_CHOICES:
            raise APIError(400, f"n={params.n} is beyond the limit of {MAX_CHOICES} choices per request", param="n")
        ctx = context("chatcmpl", req)
        streams = await submit([prompt_ids], params, ctx.id)
        wants_logprobs = params.logprobs is not None
        if req.stream:
            return EngineStreamingResponse(chat_chunks(streams[0], ctx, params.n, wants_logprobs, plan,
                                                       reasoning_parser), streams)
        (out,) = await collect(streams, request)
        choices = []
        for o in out.outputs:
            thought, text = reasoning_parser.split(o.text) if reasoning_parser is not None else (None, o.text)
            message = final_message(plan, text, o.finish_reason)
            out_message = p.ChatMessageOut(content=message.content, reasoning_content=thought,
                                           tool_calls=message.tool_calls)
            choices.append(p.ChatChoice(index=o.index, finish_reason=message.finish_reason, message=out_message,
                                        logprobs=formatter.chat(o.logprobs) if wants_logprobs else None))
        usage = p.UsageInfo.of(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs),
                               out.num_cached_tokens)
        return p.ChatCompletionResponse(**ctx.common(), choices=choices, usage=usage).model_dump()

    return router
