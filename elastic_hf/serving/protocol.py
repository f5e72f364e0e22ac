"""OpenAI wire format (completions, chat completions, errors) as pydantic v2 models; tools in tool_protocol.py,
/v1/models in model_cards.py.

Request models check types and presence only; value ranges are checked once, by `SamplingParams` and the
engine, so the HTTP API and the Python API give the same messages with the same numbers.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.sampling_params import RequestOutputKind, SamplingParams
from elastic_hf.engine.structured_outputs import StructuredOutputsParams
from elastic_hf.serving.structured_request import request_constraint
from elastic_hf.serving.tool_protocol import (ChatTool, DeltaToolCall, ResponseFormat, ToolCall, ToolChoice,
                                              arguments_object)

# Fields of the OpenAI / vLLM APIs this server knows and does not implement: a request that sets them gets a 400
# naming them rather than an answer that silently ignores them. Any other unknown field is accepted and logged.
REFUSED_FIELDS = ("audio", "modalities", "prediction", "web_search_options", "functions", "function_call",
                  "chat_template", "documents", "logits_processors", "priority", "guided_whitespace_pattern",
                  "prompt_embeds", "mm_processor_kwargs", "return_tokens_as_token_ids")


# ---------------------------------------------------------------- errors
class ErrorInfo(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---------------------------------------------------------------- shared request fields
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False           # one last chunk with the request's usage (OpenAI)
    continuous_usage_stats: bool = False  # usage so far on every chunk (vLLM)


class SamplingRequest(BaseModel):
    """Fields and checks shared by completion and chat requests: sampling options and streaming."""

    # Unknown fields are accepted (clients send vendor extensions) and logged once per name, as vLLM does; the ones
    # this server knows and does not implement are refused (REFUSED_FIELDS).
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # extensions understood by vLLM-style clients
    top_k: int | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # vLLM's: requests share cached prompt KV only with requests of the same salt (tenant isolation)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    min_p: float | None = None
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    # structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def unsupported(self) -> list[str]:
        """Names of requested features this server does not implement (a clear 400 beats silently ignoring)."""
        extra = self.model_extra or {}
        harmless = {"modalities": ["text"]}   # what a text-only request may say without asking for anything
        return [name for name in REFUSED_FIELDS
                if extra.get(name) not in (None, False, [], {}) and extra[name] != harmless.get(name)]

    def unknown_fields(self) -> list[str]:
        """Fields of the request that no API this server follows defines (accepted; the server logs them)."""
        return sorted(set(self.model_extra or {}) - set(REFUSED_FIELDS))

    def constraint(self) -> StructuredOutputsParams | None:
        return request_constraint(self)

    def logprob_options(self) -> tuple[int | None, int | None]:
        """(logprobs, prompt_logprobs) for SamplingParams: how many alternatives per output / prompt token."""
        return None, None

    def sampling_params(self, max_tokens: int, defaults: dict | None = None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """Raises ValueError naming the argument and its allowed range. defaults: the values of fields the request
        leaves unset (the model's generation_config.json), else OpenAI's. constraint: the output's structure
        (self.constraint(), or a forced tool call's)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        defaults = defaults or {}

        def value(name: str, fallback):
            given = getattr(self, name)
            return given if given is not None else defaults.get(name, fallback)

        return SamplingParams(
            max_tokens=max_tokens,
            temperature=value("temperature", 1.0),
            top_p=value("top_p", 1.0),
            top_k=value("top_k", 0) or 0,
            repetition_penalty=value("repetition_penalty", 1.0), min_p=value("min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            min_tokens=self.min_tokens, logit_bias=self.logit_bias, bad_words=list(self.bad_words or []),
            allowed_token_ids=self.allowed_token_ids, structured_outputs=constraint,
            seed=self.seed, n=self.n, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            **dict(zip(("logprobs", "prompt_logprobs"), self.logprob_options())), cache_salt=self.cache_salt,
            # a stream sends what is new each step; a plain response needs only the end
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    # str | list[str] | token ids | list of token-id lists, as in the OpenAI API
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None   # the k most likely alternatives of each token (0: only the token's own)

    def logprob_options(self) -> tuple[int | None, int | None]:
        # with echo, the prompt's tokens are part of the choice's text and get log-probabilities too
        return self.logprobs, (self.logprobs if self.echo else None)

    def unsupported(self) -> list[str]:
        names = super().unsupported()
        if self.suffix:
            names.append("suffix")
        if self.best_of not in (None, 1) and self.best_of != self.n:
            names.append("best_of")
        if self.echo and self.stream:
            names.append("echo with stream")
        return names

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return [""]  # the engine rejects it with its own message
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    # fields clients echo back from earlier responses (refusal, annotations, ...) are not the model's input
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None   # an assistant turn's calls
    tool_call_id: str | None = None            # a tool turn: the call it answers

    def template_message(self) -> dict[str, Any]:
        """The message as transformers' chat templates take it: "developer" as "system" (templates know only the
        latter), tool calls with their arguments as objects (templates render them with tojson)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                                   "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name,
                                                   "arguments": arguments_object(c.function.arguments)}}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"messages: content part type {part.get('type')!r} is not supported; "
                                 f"only 'text' parts are")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: int | None = None

    def logprob_options(self) -> tuple[int | None, int | None]:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest(f"top_logprobs={self.top_logprobs} needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None, None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None   # extra template variables (e.g. enable_thinking)
    continue_final_message: bool = False   # vLLM's: the output continues the last (assistant) message

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def template_kwargs(self) -> dict[str, Any]:
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidRequest("continue_final_message needs add_generation_prompt: false (a new assistant turn "
                                 "cannot continue the last message)", param="continue_final_message")
        kwargs = dict(self.chat_template_kwargs or {})
        reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt", "tokenize", "return_dict",
                                          "chat_template", "documents", "continue_final_message"})
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}: they are request fields or "
                                 f"the server's", param="chat_template_kwargs")
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0   # prompt tokens whose KV the prefix cache held (not computed again)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token (the first echoed prompt token has
    null log-probability and alternatives)."""
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None   # a thinking model's reasoning (--reasoning-parser), vLLM's field
    tool_calls: list[ToolCall] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# stream chunks of /v1/completions reuse CompletionResponse (same object name in the OpenAI API)
CompletionChunk = CompletionResponse
