"""Tool calls without a model: the parsers of `tool_choice: "auto"` (hermes, llama3_json, pythonic), the stream that
turns text deltas into OpenAI's tool-call deltas (content up to the calls, id and name first, then arguments), and
the tool plans (schemas of required / named choices, vLLM's refusals)."""
import json
from types import SimpleNamespace

import pytest

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.serving.tool_calls import ToolCallStream, ToolPlan, final_message, plan_tools, scan_required
from elastic_hf.serving.tool_parsers import tool_parser
from elastic_hf.serving.tool_protocol import ChatTool, NamedToolChoice, ResponseFormat


def _calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]


def test_parsers_read_their_formats_and_leave_text_alone():
    hermes = tool_parser("hermes")
    out = hermes.parse('Let me check.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
                       '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert out.content == "Let me check." and _calls(out) == [("f", {"a": 1}), ("g", {})]
    assert hermes.parse("no calls here").calls == []
    assert hermes.parse("<tool_call>not json</tool_call>").content == "<tool_call>not json</tool_call>"
    llama = tool_parser("llama3_json")
    assert _calls(llama.parse('{"name": "f", "parameters": {"x": "y"}}; {"name": "g", "parameters": {}}')) == \
        [("f", {"x": "y"}), ("g", {})]
    assert llama.parse("Hello {there}").calls == []
    pythonic = tool_parser("pythonic")
    assert _calls(pythonic.parse('[get_weather(city="Oslo", days=2), now()]')) == \
        [("get_weather", {"city": "Oslo", "days": 2}), ("now", {})]
    assert pythonic.parse("[1, 2]").calls == []
    with pytest.raises(ValueError, match="hermes"):
        tool_parser("nope")


def _feed_all(stream: ToolCallStream, pieces: list[str]):
    content, calls = "", {}
    for k, piece in enumerate(pieces):
        text, deltas = stream.feed(piece, finished=k == len(pieces) - 1)
        content += text or ""
        for d in deltas:
            if d.index not in calls:
                assert d.id and d.function.name
                calls[d.index] = [d.function.name, ""]
            calls[d.index][1] += d.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)]


def test_streams_emit_names_first_then_argument_fragments():
    text = '[{"name": "f", "parameters": {"a": "x}y"}}, {"name": "g", "parameters": {"b": [1, {"c": 2}]}}]'
    pieces = [text[i:i + 3] for i in range(0, len(text), 3)]
    content, calls = _feed_all(ToolCallStream(ToolPlan("required")), pieces)
    assert content == "" and calls == [("f", '{"a": "x}y"}'), ("g", '{"b": [1, {"c": 2}]}')]
    assert [name for name, _, end in scan_required(text[:40])] == ["f", "g"][:len(scan_required(text[:40]))]
    content, calls = _feed_all(ToolCallStream(ToolPlan("named", function="f")), ['{"a"', ': 1', "}"])
    assert calls == [("f", '{"a": 1}')]
    auto = ToolPlan("auto", parser=tool_parser("hermes"))
    content, calls = _feed_all(ToolCallStream(auto), ["Sure", ". <tool", "_call>", '{"name": "f", "arguments": ',
                                                      '{"q": 1}}</tool_call>'])
    assert content.strip() == "Sure." and calls == [("f", '{"q": 1}')]
    content, calls = _feed_all(ToolCallStream(auto), ["a <", "b> c"])
    assert content == "a <b> c" and calls == []   # a held-back "<" that began no marker is sent after all


def test_final_messages_of_each_plan():
    named = final_message(ToolPlan("named", function="f"), '{"a": 1}', "stop")
    assert named.content is None and named.tool_calls[0].function.arguments == '{"a": 1}'
    cut = final_message(ToolPlan("named", function="f"), '{"a": ', "length")
    assert cut.tool_calls is None and cut.content == '{"a": ' and cut.finish_reason == "length"
    required = final_message(ToolPlan("required"), '[{"name": "g", "parameters": {}}]', "stop")
    assert required.finish_reason == "tool_calls" and required.tool_calls[0].function.name == "g"
    plain = final_message(ToolPlan("auto", parser=tool_parser("hermes")), "just text", "stop")
    assert plain.content == "just text" and plain.tool_calls is None and plain.finish_reason == "stop"


def _request(tools=None, tool_choice=None, parallel_tool_calls=None, response_format=None):
    return SimpleNamespace(tools=[ChatTool.model_validate(t) for t in tools or []], tool_choice=tool_choice,
                           parallel_tool_calls=parallel_tool_calls,
                           response_format=ResponseFormat.model_validate(response_format) if response_format else None)


def test_plans_build_schemas_and_refuse_what_cannot_be_served():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    assert plan_tools(_request(), None).mode == "none"
    with pytest.raises(InvalidRequest, match="needs tools"):
        plan_tools(_request(tool_choice="required"), None)
    with pytest.raises(InvalidRequest, match="--enable-auto-tool-choice"):
        plan_tools(_request(tools), None)
    assert plan_tools(_request(tools), tool_parser("hermes")).mode == "auto"
    required = plan_tools(_request(tools, "required", parallel_tool_calls=False), None)
    schema = required.constraint.json
    assert schema["maxItems"] == 1 and [s["properties"]["name"]["const"] for s in schema["items"]["anyOf"]] == \
        ["f", "g"]
    named = plan_tools(_request(tools, NamedToolChoice.model_validate({"function": {"name": "g"}})), None)
    assert named.function == "g" and named.constraint.json == {"type": "object"}
    with pytest.raises(InvalidRequest, match="response_format"):
        plan_tools(_request(tools, "required", response_format={"type": "json_object"}), None)


def test_reasoning_parsers_split_whole_outputs_and_streams():
    from elastic_hf.serving.reasoning_parsers import ReasoningStream, reasoning_parser

    qwen3, r1 = reasoning_parser("qwen3"), reasoning_parser("deepseek_r1")
    assert qwen3.split("<think>\nstep 1\n</think>\n\nParis") == ("step 1", "Paris")
    assert qwen3.split("Paris") == (None, "Paris")
    assert r1.split("step 1</think>Paris") == ("step 1", "Paris")
    assert r1.split("still thinking") == ("still thinking", "")   # cut by the length limit inside the reasoning
    for parser, text in [(qwen3, "<think>\nab c</think>\n\nPar is"), (r1, "ab c</think>Par is"), (qwen3, "Par is")]:
        for size in (1, 2, 5):
            stream, thought, answer = ReasoningStream(parser), "", ""
            pieces = [text[i:i + size] for i in range(0, len(text), size)]
            for k, piece in enumerate(pieces):
                r, c = stream.feed(piece, finished=k == len(pieces) - 1)
                thought, answer = thought + (r or ""), answer + (c or "")
            want = parser.split(text)
            assert (thought.strip("\n") or None, answer) == want, (parser.name, size, thought, answer)
