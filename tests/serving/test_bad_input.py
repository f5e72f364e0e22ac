"""Bad input gets an OpenAI-style 4xx with a clear message while other streams keep going and finish with the
right text; a client that disconnects mid-stream (or mid non-streaming request) gets its KV blocks freed."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from serving_helpers import PROMPTS, TINY_MAX_MODEL_LEN

LONG_TOKENS = 600  # a few seconds of decoding a stream (they restart until the bad requests are done)


def _bad_cases(model_id: str, max_body_bytes: int):
    """(name, path, raw body or JSON, expected status, substrings the message must contain)."""
    long_prompt = "hello " * (TINY_MAX_MODEL_LEN + 200)
    ok = {"model": model_id, "prompt": "Hello"}
    chat = {"model": model_id, "messages": [{"role": "user", "content": "Hi"}]}
    return [
        ("malformed json", "/v1/completions", b'{"model": "x", "prompt": ', 400, ["not valid JSON"]),
        ("json not an object", "/v1/completions", b'[1, 2]', 400, ["JSON object"]),
        ("missing prompt", "/v1/completions", {"model": model_id}, 400, ["prompt", "required"]),
        ("missing model", "/v1/completions", {"prompt": "Hello"}, 400, ["model", "required"]),
        ("missing messages", "/v1/chat/completions", {"model": model_id}, 400, ["messages"]),
        ("wrong type", "/v1/completions", {**ok, "temperature": "hot"}, 400, ["temperature"]),
        ("max_tokens 0", "/v1/completions", {**ok, "max_tokens": 0}, 400, ["max_tokens", "0"]),
        ("max_tokens negative", "/v1/completions", {**ok, "max_tokens": -5}, 400, ["max_tokens", "-5"]),
        ("max_tokens beyond limit", "/v1/completions", {**ok, "max_tokens": 100000}, 400,
         ["max_tokens", "100000", str(TINY_MAX_MODEL_LEN)]),
        ("prompt + max_tokens beyond limit", "/v1/completions",
         {**ok, "prompt": "hello " * (TINY_MAX_MODEL_LEN - 10), "max_tokens": 100}, 400,
         ["max_tokens", str(TINY_MAX_MODEL_LEN)]),
        ("chat max_completion_tokens 0", "/v1/chat/completions", {**chat, "max_completion_tokens": 0}, 400,
         ["max_completion_tokens"]),
        ("prompt too long", "/v1/completions", {**ok, "prompt": [1000] * (TINY_MAX_MODEL_LEN + 200)}, 400,
         [str(TINY_MAX_MODEL_LEN + 200), str(TINY_MAX_MODEL_LEN)]),
        ("text prompt too long", "/v1/completions", {**ok, "prompt": long_prompt}, 400,
         ["prompt has", str(TINY_MAX_MODEL_LEN)]),
        ("chat prompt too long", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": long_prompt}]}, 400, [str(TINY_MAX_MODEL_LEN)]),
        ("empty prompt", "/v1/completions", {**ok, "prompt": ""}, 400, ["empty"]),
        ("one bad prompt of a batch", "/v1/completions", {**ok, "prompt": ["Hello", "", "World"]}, 400, ["empty"]),
        ("token id out of vocab", "/v1/completions", {**ok, "prompt": [1, 2, 10**9]}, 400, ["token ids"]),
        ("unknown model", "/v1/completions", {**ok, "model": "gpt-99"}, 404, ["gpt-99", model_id]),
        ("negative temperature", "/v1/completions", {**ok, "temperature": -0.5}, 400, ["temperature", "-0.5"]),
        ("top_p zero", "/v1/completions", {**ok, "top_p": 0}, 400, ["top_p", "(0, 1]"]),
        ("top_p above one", "/v1/chat/completions", {**chat, "top_p": 1.5}, 400, ["top_p", "1.5"]),
        ("n zero", "/v1/completions", {**ok, "n": 0}, 400, ["n must be"]),
        ("n too large", "/v1/chat/completions", {**chat, "n": 1000}, 400, ["n=1000", "128"]),
        ("too many logprobs", "/v1/completions", {**ok, "logprobs": 21}, 400, ["logprobs", "[0, 20]", "21"]),
        ("top_logprobs without logprobs", "/v1/chat/completions", {**chat, "top_logprobs": 2}, 400,
         ["top_logprobs=2", "logprobs: true"]),
        ("presence penalty out of range", "/v1/completions", {**ok, "presence_penalty": 2.5}, 400,
         ["presence_penalty", "[-2, 2]", "2.5"]),
        ("logit_bias out of range", "/v1/completions", {**ok, "logit_bias": {"5": 101}}, 400, ["logit_bias", "101"]),
        ("logit_bias token out of vocab", "/v1/completions", {**ok, "logit_bias": {str(10**9): 1}}, 400,
         ["logit_bias", str(10**9)]),
        ("min_tokens beyond max_tokens", "/v1/completions", {**ok, "min_tokens": 50}, 400, ["min_tokens", "50"]),
        ("invalid JSON schema", "/v1/chat/completions",
         {**chat, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         400, ["response_format", "type"]),
        ("invalid regex", "/v1/completions", {**ok, "guided_regex": "(("}, 400, ["guided_regex", "regex"]),
        ("two constraints", "/v1/completions", {**ok, "guided_regex": "a", "guided_choice": ["b"]}, 400,
         ["guided_regex", "guided_choice"]),
        ("other grammar backend", "/v1/completions", {**ok, "guided_json": {}, "guided_decoding_backend": "outlines"},
         400, ["outlines", "llguidance"]),
        ("auto tool choice not enabled", "/v1/chat/completions",
         {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
         ["--enable-auto-tool-choice", "--tool-call-parser"]),
        ("unknown named tool", "/v1/chat/completions",
         {**chat, "tools": [{"type": "function", "function": {"name": "f"}}],
          "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, ["'g'", "f"]),
        ("a refused field", "/v1/chat/completions", {**chat, "modalities": ["text", "audio"]}, 400, ["modalities"]),
        ("continue_final_message with a generation prompt", "/v1/chat/completions",
         {**chat, "continue_final_message": True}, 400, ["continue_final_message", "add_generation_prompt"]),
        ("reserved template kwarg", "/v1/chat/completions", {**chat, "chat_template_kwargs": {"tools": []}}, 400,
         ["chat_template_kwargs", "tools"]),
        ("oversize body", "/v1/completions", {**ok, "prompt": "x" * (max_body_bytes + 10)}, 413,
         [str(max_body_bytes)]),
        # request-cost limits and values that would overflow in a step (the second hardening issue, item 7)
        ("NaN temperature", "/v1/completions",
         f'{{"model": "{model_id}", "prompt": "Hi", "temperature": NaN}}'.encode(), 400, ["temperature", "finite"]),
        ("infinite repetition penalty", "/v1/chat/completions",
         json.dumps({**chat, "repetition_penalty": float("inf")}).encode(), 400, ["repetition_penalty", "finite"]),
        ("too many stop token ids", "/v1/completions", {**ok, "stop_token_ids": list(range(2000))}, 400,
         ["1024 stop_token_ids", "2000"]),
        ("deeply nested json", "/v1/completions",
         b'{"model": "x", "prompt": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", 400, ["nests too deeply"]),
    ]


def _stream_text(server, prompt: str, max_tokens: int, result: dict, first_chunk: threading.Event):
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    parts, finish = [], None
    try:
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=server.headers,
                          timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if not line or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                for choice in chunk["choices"]:
                    parts.append(choice["text"])
                    finish = choice["finish_reason"] or finish
                first_chunk.set()
        result["text"], result["finish"] = "".join(parts), finish
    except BaseException as exc:  # reported by the main thread
        result["error"] = repr(exc)
    finally:
        first_chunk.set()


def _streams_until(server, prompt: str, runs: list[dict], first_chunk: threading.Event, stop: threading.Event):
    """Streams `prompt` again and again until `stop`, each run's result appended to `runs` before it starts: the
    streams stay in flight however fast the engine decodes (one run of LONG_TOKENS once outlived every bad request;
    a faster step no longer did)."""
    while not stop.is_set():
        runs.append({})
        _stream_text(server, prompt, LONG_TOKENS, runs[-1], first_chunk)


def test_bad_input_4xx_while_streams_finish(tiny_server):
    prompts = PROMPTS[:4]
    runs = [[] for _ in prompts]
    started = [threading.Event() for _ in prompts]
    stop = threading.Event()
    threads = [threading.Thread(target=_streams_until, args=(tiny_server, p, r, e, stop))
               for p, r, e in zip(prompts, runs, started)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "in-flight streams never produced a first chunk"

    failures, not_overlapped = [], []
    with httpx.Client(base_url=tiny_server.base_url, headers=tiny_server.headers, timeout=60) as client:
        for name, path, body, status, needles in _bad_cases(tiny_server.model_id, 64 * 1024):
            if isinstance(body, bytes):
                resp = client.post(path, content=body, headers={"content-type": "application/json"})
            else:
                resp = client.post(path, json=body)
            if all("finish" in r[-1] or "error" in r[-1] for r in runs):
                not_overlapped.append(name)
            try:
                error = resp.json()["error"]
            except Exception:
                failures.append(f"{name}: {resp.status_code} body without an error object: {resp.text[:200]}")
                continue
            if resp.status_code != status:
                failures.append(f"{name}: status {resp.status_code}, want {status}: {error}")
            if not {"message", "type", "param", "code"} <= set(error):
                failures.append(f"{name}: error body lacks OpenAI fields: {error}")
            missing = [n for n in needles if n not in error["message"]]
            if missing:
                failures.append(f"{name}: message {error['message']!r} lacks {missing}")

    stop.set()
    for t in threads:
        t.join(120)
    assert not failures, "\n".join(failures)
    assert not not_overlapped, f"no stream was in flight during {not_overlapped}: the test did not overlap them"
    for prompt, prompt_runs in zip(prompts, runs):
        for result in prompt_runs:
            assert "error" not in result, result["error"]
            assert result["finish"] == "length"
            assert result["text"].startswith(tiny_server.reference[prompt]), "an in-flight stream got wrong text"
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0, stats


def test_a_vanishing_temperature_is_greedy(tiny_server):
    """3.7e-227 divided into the logits overflowed to inf and failed the step with a 500 (found by fuzzing): below
    vLLM's 1e-5 a temperature is greedy."""
    body = {"model": tiny_server.model_id, "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 3.7e-227}
    resp = httpx.post(tiny_server.base_url + "/v1/completions", json=body, headers=tiny_server.headers, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == tiny_server.reference[PROMPTS[0]]


def _abort_count(server) -> float:
    return server.metric("elastic_hf_requests_finished_total", 'finish_reason="abort"')


def test_disconnect_mid_stream_frees_blocks(tiny_server):
    aborts_before = _abort_count(tiny_server)
    body = {"model": tiny_server.model_id, "prompt": PROMPTS[4], "max_tokens": TINY_MAX_MODEL_LEN - 100,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", tiny_server.base_url + "/v1/completions", json=body, headers=tiny_server.headers,
                      timeout=60) as resp:
        lines = resp.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert tiny_server.stats()["kv_blocks_used"] > 0
    assert any(line.startswith("data: {") for line in received)
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0, stats
    assert _abort_count(tiny_server) == aborts_before + 1, "the request was not aborted (it ran to its end?)"


def test_disconnect_non_streaming_frees_blocks(tiny_server):
    aborts_before = _abort_count(tiny_server)
    body = {"model": tiny_server.model_id, "prompt": PROMPTS[5], "max_tokens": TINY_MAX_MODEL_LEN - 100,
            "temperature": 0, "ignore_eos": True}
    # The client gives up long before ~900 tokens are done (~1 s of decoding on a 2-core CI machine, where a read
    # timeout of 1 s let the request finish first); the server must notice and abort.
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.base_url + "/v1/completions", json=body, headers=tiny_server.headers,
                   timeout=httpx.Timeout(30, read=0.2))
    gave_up_after = time.monotonic() - start
    stats = tiny_server.wait_idle()
    assert stats["kv_blocks_used"] == 0 and stats["num_requests"] == 0, stats
    assert _abort_count(tiny_server) == aborts_before + 1, (
        f"the request was not aborted: it finished within the {gave_up_after:.2f} s the client waited?")
