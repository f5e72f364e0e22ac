"""The utility routes vLLM users script against, with vLLM's shapes: GET /version, GET|POST /ping, POST /tokenize
(a prompt, or chat messages through the model's chat template) and POST /detokenize. Like vLLM's, they sit
outside /v1, so the API key does not guard them; they read only the tokenizer and touch no request."""
from __future__ import annotations

import functools

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from elastic_hf import VERSION
from elastic_hf.serving import protocol as p
from elastic_hf.serving.errors import APIError, validation_error


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[p.ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


async def _body(request: Request, model: type[BaseModel]):
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc)


def utility_router(async_engine, *, names: tuple[str, ...], max_model_len: int) -> APIRouter:
    """The utility routes of the model `async_engine` serves; tokenization runs on its input thread."""
    tokenizer = async_engine.tokenizer
    router = APIRouter()

    def check_model(name: str | None) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"model {name!r} does not exist; this server serves {' or '.join(map(repr, names))}",
                           param="model",
                           code="model_not_found")

    @router.get("/version")
    async def version():
        return {"version": VERSION}

    async def ping():
        return {}

    # one route per method: each gets its own OpenAPI operation id
    router.add_api_route("/ping", ping, methods=["GET"], operation_id="ping_get")
    router.add_api_route("/ping", ping, methods=["POST"], operation_id="ping_post")

    @router.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = await _body(request, TokenizeRequest)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            try:   # the chat route's validation of messages (an empty list, bad roles: 400, found by fuzzing)
                chat = p.ChatCompletionRequest(model=names[0], messages=req.messages,
                                               add_generation_prompt=req.add_generation_prompt)
            except ValidationError as exc:
                raise validation_error(exc)
            try:
                tokens = await async_engine.on_input_thread(async_engine.input_processor.render_chat,
                                                            chat.template_messages(), chat.add_generation_prompt)
            except ValueError as exc:
                raise APIError(400, f"the chat template cannot render these messages: {exc}", param="messages")
        else:
            tokens = await async_engine.on_input_thread(
                functools.partial(tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens))
        body = {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return body

    @router.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = await _body(request, DetokenizeRequest)
        check_model(req.model)
        vocab = len(tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token ids must be in [0, {vocab}); got {bad[:8]}", param="tokens")
        return {"prompt": tokenizer.decode(req.tokens)}

    return router
