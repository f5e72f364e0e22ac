"""Tool-call parsers for `tool_choice: "auto"` (vLLM's `--tool-call-parser` names): each reads a model's finished
output and returns its text content and the function calls it made, in the format that model family was trained
to write. `hermes`: <tool_call>{"name": ..., "arguments": {...}}</tool_call> blocks (Qwen 2.5/3, Hermes, many
fine-tunes); `llama3_json`: one JSON object or several joined by ';', {"name": ..., "parameters": {...}} (Llama 3.x);
`pythonic`: a Python list of calls, [f(a=1), g(b="x")] (Llama 3.2/4 pythonic, ToolACE)."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str   # JSON text of the arguments object


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None
    calls: list[ParsedCall]


def _arguments_text(arguments) -> str:
    if isinstance(arguments, str):   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)


def _call_from_object(obj) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    return ParsedCall(obj["name"], _arguments_text(obj.get("arguments", obj.get("parameters"))))


class ToolParser:
    name = ""
    # text at which tool calls begin: a stream sends content up to it and holds everything after it back
    start_marker = ""

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def call_start(self, text: str) -> int | None:
        """Index in `text` where the tool calls begin (None: none yet)."""
        index = text.find(self.start_marker)
        return None if index < 0 else index


class HermesParser(ToolParser):
    name = "hermes"
    start_marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for block in self._block.findall(text[start:]):
            try:
                call = _call_from_object(json.loads(block))
            except json.JSONDecodeError:
                call = None
            if call is None:   # not a call after all: the whole output is text
                return ParsedOutput(text, [])
            calls.append(call)
        content = text[:start].strip()
        return ParsedOutput(content or None, calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    start_marker = "{"

    def call_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>"):
            return 0
        return 0 if stripped.startswith("{") else None

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        calls, decoder, pos = [], json.JSONDecoder(), 0
        while pos < len(body):
            try:
                obj, pos = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            call = _call_from_object(obj)
            if call is None:
                return ParsedOutput(text, [])
            calls.append(call)
            while pos < len(body) and body[pos] in " \n\t;":
                pos += 1
        return ParsedOutput(None, calls)


class PythonicParser(ToolParser):
    name = "pythonic"
    start_marker = "["

    def call_start(self, text: str) -> int | None:
        return 0 if text.lstrip().startswith("[") else None

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return ParsedOutput(text, [])
        if not isinstance(tree, ast.List) or not all(isinstance(e, ast.Call) and isinstance(e.func, ast.Name)
                                                     for e in tree.elts):
            return ParsedOutput(text, [])
        calls = []
        for call in tree.elts:
            try:
                arguments = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords if kw.arg}
            except ValueError:
                return ParsedOutput(text, [])
            calls.append(ParsedCall(call.func.id, json.dumps(arguments, ensure_ascii=False)))
        return ParsedOutput(None, calls)


TOOL_PARSERS: dict[str, type[ToolParser]] = {cls.name: cls for cls in (HermesParser, Llama3JsonParser,
                                                                       PythonicParser)}


def tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; available: {', '.join(sorted(TOOL_PARSERS))}") from None
