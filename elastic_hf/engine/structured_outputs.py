"""What a request asks its output to match (vLLM's StructuredOutputsParams): exactly one of a JSON schema, any JSON
object, a regular expression, a choice of strings or a grammar (GBNF/EBNF or Lark). Torch-free and engine-free:
the grammar engine (engine/grammar.py) compiles it; the HTTP layer builds it from `response_format`,
`structured_outputs`, vLLM's `guided_*` fields and tool choices."""
from __future__ import annotations

import json
from dataclasses import dataclass

from elastic_hf.engine.errors import InvalidRequest

# One request's constraint may not be larger than this (characters of its JSON/regex/grammar text): compiling is
# linear in it and runs on the input thread every other request's tokenization shares.
MAX_CONSTRAINT_CHARS = 256 * 1024
_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: dict | str | None = None       # a JSON schema (object or its text)
    json_object: bool = False            # any JSON object (OpenAI's response_format json_object)
    regex: str | None = None
    choice: list[str] | None = None      # the output is exactly one of these strings
    grammar: str | None = None           # GBNF / EBNF (llama.cpp's) or Lark
    param: str = "structured_outputs"    # the request field it came from, named in errors

    def __post_init__(self):
        given = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(f"{self.param}: give exactly one of {', '.join(_KINDS)}; got "
                                 f"{', '.join(given) or 'none'}", param=self.param)
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidRequest(f"{self.param}: a JSON schema must be an object, got {type(self.json).__name__}",
                                 param=self.param)
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequest(f"{self.param}: choice must be a non-empty list of non-empty strings",
                                 param=self.param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequest(f"{self.param}: {name} must be a non-empty string", param=self.param)
        size = len(self.text())
        if size > MAX_CONSTRAINT_CHARS:
            raise InvalidRequest(f"{self.param}: the constraint has {size} characters; at most "
                                 f"{MAX_CONSTRAINT_CHARS} are allowed", param=self.param)

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def text(self) -> str:
        """The constraint as one string (JSON schema text, regex, grammar, or the choices as a JSON list)."""
        kind = self.kind
        if kind == "json":
            # keys keep their order: the grammar generates properties in the schema's order
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "json_object":
            return '{"type": "object"}'
        if kind == "choice":
            return json.dumps(self.choice)
        return getattr(self, kind)

    def cache_key(self) -> tuple[str, str]:
        """Equal constraints share one compiled grammar."""
        return self.kind, self.text()
