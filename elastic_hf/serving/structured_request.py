"""Where a request's output constraint comes from: OpenAI's `response_format`, vLLM's `structured_outputs` object
and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields. At most one source per
request; the result is the engine's StructuredOutputsParams (compiled by engine/grammar.py)."""
from __future__ import annotations

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.structured_outputs import StructuredOutputsParams
from elastic_hf.serving.tool_protocol import ResponseFormat

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
# the grammar engines a request may name (vLLM's guided_decoding_backend / structured_outputs backend): this
# server compiles every constraint with llguidance, so naming another engine is refused rather than ignored
ACCEPTED_BACKENDS = (None, "auto", "guidance", "llguidance")


def from_response_format(fmt: ResponseFormat | None) -> StructuredOutputsParams | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if fmt.json_schema is None or fmt.json_schema.json_schema is None:
        raise InvalidRequest("response_format: type json_schema needs json_schema.schema", param="response_format")
    return StructuredOutputsParams(json=fmt.json_schema.json_schema, param="response_format")


def from_structured_outputs(value: dict | None) -> StructuredOutputsParams | None:
    if value is None:
        return None
    unknown = sorted(set(value) - set(_STRUCTURED_KEYS) - {"backend", "disable_any_whitespace",
                                                           "disable_additional_properties", "whitespace_pattern"})
    if unknown:
        raise InvalidRequest(f"structured_outputs: unknown or unsupported keys {unknown}; supported: "
                             f"{', '.join(_STRUCTURED_KEYS)}", param="structured_outputs")
    check_backend(value.get("backend"), "structured_outputs")
    return StructuredOutputsParams(**{k: value[k] for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)})


def from_guided_fields(request) -> StructuredOutputsParams | None:
    given = {name: getattr(request, name) for name in _GUIDED if getattr(request, name) is not None}
    if not given:
        return None
    if len(given) > 1:
        raise InvalidRequest(f"give one of {', '.join(_GUIDED)}; got {', '.join(given)}", param=next(iter(given)))
    name, value = next(iter(given.items()))
    return StructuredOutputsParams(**{_GUIDED[name]: value}, param=name)


def check_backend(backend, param: str) -> None:
    if backend not in ACCEPTED_BACKENDS:
        raise InvalidRequest(f"{param}: backend {backend!r} is not available; this server compiles constraints "
                             f"with llguidance (accepted: auto, guidance)", param=param)


def request_constraint(request) -> StructuredOutputsParams | None:
    """The one output constraint of a completion or chat request (None: free text); InvalidRequest when two fields
    ask for constraints at once."""
    check_backend(request.guided_decoding_backend, "guided_decoding_backend")
    sources = [(name, spec) for name, spec in (
        ("response_format", from_response_format(request.response_format)),
        ("structured_outputs", from_structured_outputs(request.structured_outputs)),
        ("guided_*", from_guided_fields(request))) if spec is not None]
    if len(sources) > 1:
        raise InvalidRequest(f"one output constraint per request; got {' and '.join(n for n, _ in sources)}",
                             param=sources[1][0])
    return sources[0][1] if sources else None
