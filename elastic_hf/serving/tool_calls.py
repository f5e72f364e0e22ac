"""A chat request's tools, from request to response. `plan_tools` decides how the output is produced: `none` and
`auto` leave it free (auto reads it with the server's tool-call parser), `required` and a named function constrain
it with the grammar engine, so the arguments always match the function's JSON schema. `ToolCallStream` turns one
choice's text deltas into OpenAI's stream deltas (content, or tool calls: id and name first, then argument
fragments); `final_message` does the same for a whole output."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.structured_outputs import StructuredOutputsParams
from elastic_hf.serving.tool_parsers import ParsedCall, ToolParser
from elastic_hf.serving.tool_protocol import (DeltaFunctionCall, DeltaToolCall, FunctionCall, NamedToolChoice,
                                              ToolCall, new_tool_call_id)

_ANY_OBJECT = {"type": "object"}
# the constrained `required` output, compact as the grammar writes JSON: [{"name": "f", "parameters": {...}}, ...]
_REQUIRED_HEADER = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "parameters": ')


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: str                                   # none | auto | required | named
    function: str | None = None                 # the named function
    parser: ToolParser | None = None            # auto's parser
    constraint: StructuredOutputsParams | None = None


def plan_tools(request, auto_parser: ToolParser | None) -> ToolPlan:
    """InvalidRequest for a tool_choice the request's tools or the server's flags cannot serve (vLLM's rules)."""
    tools, choice = request.tools or [], request.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools: the request defines none", param="tool_choice")
        return ToolPlan("none")
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if auto_parser is None:
            raise InvalidRequest('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                                 'set on the server; use tool_choice "required" or a named function, which need '
                                 'neither', param="tool_choice")
        return ToolPlan("auto", parser=auto_parser)
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidRequest("response_format cannot be combined with a forced tool_choice: the output is the tool "
                             "call", param="response_format")
    schemas = {t.function.name: t.function.parameters or _ANY_OBJECT for t in tools}
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in schemas:
            raise InvalidRequest(f"tool_choice names function {name!r}, which is not among the request's tools "
                                 f"({', '.join(sorted(schemas))})", param="tool_choice")
        return ToolPlan("named", function=name,
                        constraint=StructuredOutputsParams(json=schemas[name], param="tools"))
    items = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                        "required": ["name", "parameters"], "additionalProperties": False}
                       for name, schema in schemas.items()]}
    array = {"type": "array", "minItems": 1, "items": items}
    if request.parallel_tool_calls is False:
        array["maxItems"] = 1
    return ToolPlan("required", constraint=StructuredOutputsParams(json=array, param="tools"))


def _json_value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object or array that begins at text[start]; None while it is incomplete."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_required(text: str) -> list[tuple[str, int, int | None]]:
    """The calls of a (possibly partial) `required` output: (name, arguments start, arguments end or None)."""
    calls, pos = [], 1 if text.startswith("[") else None
    while pos is not None:
        match = _REQUIRED_HEADER.match(text, pos)
        if match is None:
            break
        end = _json_value_end(text, match.end())
        calls.append((match.group(1), match.end(), end))
        pos = end + 3 if end is not None and text.startswith("}, ", end) else None
    return calls


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(function=FunctionCall(name=call.name, arguments=call.arguments))


@dataclass(frozen=True, slots=True)
class FinalMessage:
    content: str | None
    tool_calls: list[ToolCall] | None
    finish_reason: str | None


def final_message(plan: ToolPlan, text: str, finish_reason: str | None) -> FinalMessage:
    """A whole output as the assistant's message. A forced call that was cut short (finish_reason length) stays
    text: its JSON is incomplete."""
    if plan.mode == "named" and finish_reason != "length":
        return FinalMessage(None, [_tool_call(ParsedCall(plan.function, text))], finish_reason)
    if plan.mode == "required" and finish_reason != "length":
        calls = [ParsedCall(name, text[start:end]) for name, start, end in scan_required(text) if end is not None]
        if calls:
            return FinalMessage(None, [_tool_call(c) for c in calls], "tool_calls")
    if plan.mode == "auto":
        parsed = plan.parser.parse(text)
        if parsed.calls:
            return FinalMessage(parsed.content, [_tool_call(c) for c in parsed.calls],
                                "tool_calls" if finish_reason == "stop" else finish_reason)
    return FinalMessage(text, None, finish_reason)


@dataclass
class ToolCallStream:
    """One choice's stream under a tool plan: `feed(delta_text)` -> (content delta, tool-call deltas)."""
    plan: ToolPlan
    text: str = ""
    content_sent: int = 0          # characters of `text` sent as content
    headers_sent: int = 0          # tool calls whose id and name went out
    arguments_sent: list[int] = field(default_factory=list)   # per call: argument characters sent
    ids: list[str] = field(default_factory=list)

    @property
    def made_calls(self) -> bool:
        return self.headers_sent > 0

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        if self.plan.mode == "named":
            return None, self._stream_calls([(self.plan.function, 0, None)])   # the whole output is arguments
        if self.plan.mode == "required":
            return None, self._stream_calls(scan_required(self.text))
        if self.plan.mode == "auto":
            return self._feed_auto(finished)
        return (delta or None), []

    def _stream_calls(self, calls: list[tuple[str, int, int | None]]) -> list[DeltaToolCall]:
        """calls: (name, arguments start, arguments end or None while open: all text so far is arguments)."""
        out = []
        for index, (name, start, end) in enumerate(calls):
            if index >= self.headers_sent:
                self.ids.append(new_tool_call_id())
                self.arguments_sent.append(0)
                self.headers_sent += 1
                out.append(DeltaToolCall(index=index, id=self.ids[index], type="function",
                                         function=DeltaFunctionCall(name=name, arguments="")))
            stop = end if end is not None else len(self.text)
            fragment = self.text[start + self.arguments_sent[index]:stop]
            if fragment:
                self.arguments_sent[index] += len(fragment)
                out.append(DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=fragment)))
        return out

    def _feed_auto(self, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        parser = self.plan.parser
        start = parser.call_start(self.text)
        if start is None:
            # hold back a tail that could still grow into the parser's start marker
            marker = parser.start_marker
            hold = next((k for k in range(min(len(marker) - 1, len(self.text)), 0, -1)
                         if marker.startswith(self.text[-k:])), 0) if not finished else 0
            return self._content_until(len(self.text) - hold), []
        content = self._content_until(start)
        if not finished:
            return content, []
        parsed = parser.parse(self.text)
        if not parsed.calls:   # the marker began no valid call: the rest is text after all
            return (content or "") + (self._content_until(len(self.text)) or "") or None, []
        deltas = []
        for index, call in enumerate(parsed.calls):
            self.ids.append(new_tool_call_id())
            deltas.append(DeltaToolCall(index=index, id=self.ids[-1], type="function",
                                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
        self.headers_sent = len(parsed.calls)
        return content, deltas

    def _content_until(self, end: int) -> str | None:
        if end <= self.content_sent:
            return None
        piece = self.text[self.content_sent:end]
        self.content_sent = end
        return piece
