"""Structured output, tools and the sampling fields through the real openai client against the default model
(SmolLM2-135M-Instruct, served with --tool-call-parser hermes): parse() returns a pydantic object, json_object
outputs load, forced tool calls (required, named; streamed and not) carry arguments valid against their schema, a
tool result round-trips through the chat template, logit_bias bans the greedy token, min_tokens outlasts a stop
string, penalties change the output, and unknown fields are accepted while known unimplemented ones are refused."""
import json
import logging

import jsonschema
import openai
import pytest
from pydantic import BaseModel

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Oslo right now?"}]


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def client(default_server):
    return openai.OpenAI(base_url=default_server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _create(client, server, **kwargs):
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_tokens", 80)
    return client.chat.completions.create(model=server.model_id, **kwargs)


def test_parse_returns_a_pydantic_object(client, default_server):
    resp = client.chat.completions.parse(model=default_server.model_id, response_format=City, temperature=0,
                                         max_tokens=100, messages=[{"role": "user", "content": "Tell me about Paris."}])
    city = resp.choices[0].message.parsed
    assert isinstance(city, City) and city.name and resp.choices[0].finish_reason == "stop"


def test_json_object_outputs_always_load(client, default_server):
    prompts = ["Return a JSON object with keys name and age for a person called Bob who is 30.",
               "Describe a cat in JSON with two fields."]
    for prompt in prompts:
        resp = _create(client, default_server, messages=[{"role": "user", "content": prompt}], max_tokens=150,
                       response_format={"type": "json_object"})
        assert resp.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(resp.choices[0].message.content), dict)


def _validate(calls):
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def _streamed_calls(stream) -> tuple[list[dict], str | None]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:   # a call's first delta names it
                assert delta.id and delta.function.name and delta.type == "function"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_are_valid_streamed_and_not(client, default_server, choice):
    resp = _create(client, default_server, messages=ASK, tools=TOOLS, tool_choice=choice)
    message = resp.choices[0].message
    calls = [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
    assert calls and message.content is None
    _validate(calls)
    assert resp.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    if choice != "required":
        assert [c["name"] for c in calls] == ["get_weather"]
    streamed, finish = _streamed_calls(_create(client, default_server, messages=ASK, tools=TOOLS, tool_choice=choice,
                                               stream=True))
    assert [(c["name"], c["arguments"]) for c in streamed] == [(c["name"], c["arguments"]) for c in calls]
    assert finish == resp.choices[0].finish_reason
    single = _create(client, default_server, messages=ASK, tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1


def test_a_tool_result_round_trips(client, default_server):
    first = _create(client, default_server, messages=ASK, tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "12 degrees and rain"}]
    answer = _create(client, default_server, messages=history, tools=TOOLS, tool_choice="auto", max_tokens=40)
    assert answer.choices[0].message.content and answer.usage.prompt_tokens > first.usage.prompt_tokens
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_logit_bias_min_tokens_and_penalties(client, default_server):
    plain = _create(client, default_server, messages=ASK, max_tokens=12, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    first_id = default_server.model.tokenizer.convert_tokens_to_ids(first)
    banned = _create(client, default_server, messages=ASK, max_tokens=12, logit_bias={str(first_id): -100},
                     logprobs=True)
    assert banned.choices[0].logprobs.content[0].token != first
    text = plain.choices[0].message.content
    stop = text.split()[1]   # a word the greedy output reaches within a few tokens
    cut = _create(client, default_server, messages=ASK, max_tokens=16, stop=[stop])
    held = _create(client, default_server, messages=ASK, max_tokens=16, stop=[stop], extra_body={"min_tokens": 12})
    assert cut.usage.completion_tokens < 12 <= held.usage.completion_tokens
    penalised = _create(client, default_server, messages=ASK, max_tokens=12, presence_penalty=2.0,
                        frequency_penalty=2.0)
    assert penalised.choices[0].message.content != plain.choices[0].message.content


def test_guided_fields_and_structured_outputs_on_completions(client, default_server):
    for extra, check in [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
                         ({"guided_regex": r"\d{4}"}, lambda t: len(t) == 4 and t.isdigit()),
                         ({"structured_outputs": {"grammar": 'root ::= "A" | "B"'}}, lambda t: t in ("A", "B")),
                         ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": TIME}}},
                          lambda t: jsonschema.validate(json.loads(t), TIME) is None)]:
        resp = client.completions.create(model=default_server.model_id, prompt="Q: Is Oslo in Norway?\nA:",
                                         max_tokens=40, temperature=0, extra_body=extra)
        assert check(resp.choices[0].text), (extra, resp.choices[0].text)


def test_continue_final_message_continues_the_assistant_turn(client, default_server):
    start = "The capital of France is"
    history = [{"role": "user", "content": "Tell me about France."}, {"role": "assistant", "content": start}]
    resp = _create(client, default_server, messages=history, max_tokens=6,
                   extra_body={"continue_final_message": True, "add_generation_prompt": False})
    prompt = default_server.model.tokenizer.apply_chat_template(history, continue_final_message=True, tokenize=True,
                                                                 return_dict=False)
    assert resp.usage.prompt_tokens == len(prompt) and resp.choices[0].message.content


def test_unknown_fields_are_logged_once_and_refused_fields_named(client, default_server, caplog):
    with caplog.at_level(logging.WARNING, logger="elastic_hf.serving.openai_routes"):
        for _ in range(2):
            resp = _create(client, default_server, messages=ASK, max_tokens=4, extra_body={"vendor_knob_xyz": 1})
            assert resp.choices[0].message.content
    assert sum("vendor_knob_xyz" in r.message for r in caplog.records) == 1
    with pytest.raises(openai.BadRequestError, match="audio"):
        _create(client, default_server, messages=ASK, max_tokens=4, extra_body={"audio": {"voice": "alloy"}})


def test_reasoning_is_split_from_the_answer(client, default_server):
    """The server runs --reasoning-parser qwen3; a regex makes the model write a <think> part, as a thinking model
    would, and the response carries it as reasoning_content, streamed and not."""
    extra = {"guided_regex": r"<think>\nI recall [a-z]{2,12}\.\n</think>\n\n[A-Z][a-z]{2,12}"}
    resp = _create(client, default_server, messages=[{"role": "user", "content": "Capital of France?"}],
                   max_tokens=40, extra_body=extra)
    message = resp.choices[0].message
    assert message.reasoning_content.startswith("I recall") and "think>" not in message.content
    stream = _create(client, default_server, messages=[{"role": "user", "content": "Capital of France?"}],
                     max_tokens=40, extra_body=extra, stream=True)
    thought, answer = "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            thought += getattr(delta, "reasoning_content", None) or ""
            answer += delta.content or ""
    assert (thought.strip("\n"), answer) == (message.reasoning_content, message.content)
