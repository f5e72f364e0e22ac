"""OpenAI wire format (completions, chat completions, models, errors) as pydantic v2 models.

Request models check types and presence only; value ranges are checked once, by `SamplingParams` and the
engine, so the HTTP API and the Python API give the same messages with the same numbers.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from elastic_hf.engine.sampling_params import SamplingParams


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
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields and checks shared by completion and chat requests: sampling options and streaming."""

    # Unknown fields (logit_bias, logprobs=False, ...) are ignored like most OpenAI-compatible servers do.
    model_config = ConfigDict(extra="ignore")

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
    # accepted so clients that always send them work; non-default values are refused (see unsupported())
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: Union[bool, int, None] = None
    top_logprobs: int | None = None

    def unsupported(self) -> list[str]:
        """Names of requested features this server does not implement (a clear 400 beats silently ignoring)."""
        names = [name for name in ("presence_penalty", "frequency_penalty") if getattr(self, name)]
        if self.logprobs or self.top_logprobs:
            names.append("logprobs")
        return names

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises ValueError naming the argument and its allowed range."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, n=self.n, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    # str | list[str] | token ids | list of token-id lists, as in the OpenAI API
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

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
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None

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

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        # "developer" is OpenAI's new name for "system"; HF chat templates only know "system".
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


# ---------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# stream chunks of /v1/completions reuse CompletionResponse (same object name in the OpenAI API)
CompletionChunk = CompletionResponse


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "elastic-hf"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
