"""OpenAI's tool-calling wire format: function tools of a chat request, the assistant's tool calls (in a request's
history, in a response, and as stream deltas), and response_format."""
from __future__ import annotations

import json
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(BaseModel):
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: new_tool_call_id())
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One fragment of a streamed tool call: the first carries id, type and name, the next ones argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def arguments_object(arguments: str) -> Any:
    """A tool call's JSON arguments as an object (what chat templates expect); text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, TypeError):
        return arguments
