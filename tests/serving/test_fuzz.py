"""A fuzzing pass over the HTTP API: schemathesis generates requests from the server's own OpenAPI document
(every request body declared: serving/openapi_doc.py), valid and invalid, for every operation, and hypothesis
mutates valid chat and completion bodies one field at a time. No response may be >= 500 other than 503/504 (by
design: draining, overload, timeouts); afterwards the server still serves the exact greedy text and holds no KV
block. The counts are printed (run with -s to see them). ELASTIC_HF_FUZZ_SCALE multiplies the number of examples:
the slow tier runs scale 1 (~700 requests); scale 3 is the 2,000-request pass of the closing note."""
from __future__ import annotations

import collections
import os

import httpx
import pytest

from serving_helpers import PROMPTS, tiny_model_server

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

FUZZ_MAX_MODEL_LEN = 32      # every generated max_tokens is cheap: the pass measures robustness, not decoding
SCALE = float(os.environ.get("ELASTIC_HF_FUZZ_SCALE", "1"))
EXAMPLES_PER_OPERATION = int(130 * SCALE)
MUTATIONS = int(200 * SCALE)
ALLOWED_5XX = {503, 504}
_SETTINGS = settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                     suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(serving_checkpoint):
    with tiny_model_server(serving_checkpoint, max_model_len=FUZZ_MAX_MODEL_LEN, model_options={"max_num_seqs": 16},
                           prompts=PROMPTS[:1], enable_docs=True, max_body_bytes=256 * 1024) as handle:
        yield handle


def _record(statuses: collections.Counter, failures: list, what: str, response) -> None:
    statuses[response.status_code] += 1
    if response.status_code >= 500 and response.status_code not in ALLOWED_5XX:
        failures.append(f"{what}: {response.status_code} {response.text[:300]}")


def test_fuzzed_requests_never_get_a_5xx_and_leave_the_server_exact(fuzz_server):
    base = fuzz_server.base_url
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    statuses, failures = collections.Counter(), []
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        @_SETTINGS
        @given(case=operation.as_strategy())
        def run(case):
            _record(statuses, failures, f"{case.method} {case.path} {str(case.body)[:200]}",
                    case.call(base_url=base, timeout=60))
        run()

    valid = {"/v1/completions": {"model": fuzz_server.model_id, "prompt": "Hello", "max_tokens": 4},
             "/v1/chat/completions": {"model": fuzz_server.model_id, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hi"}]}}
    values = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                       st.text(max_size=40), st.lists(st.integers(), max_size=5),
                       st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
              "stream", "logprobs", "top_logprobs", "echo", "repetition_penalty", "stop_token_ids", "ignore_eos",
              "presence_penalty", "frequency_penalty", "stream_options", "cache_salt", "max_completion_tokens",
              "min_p", "min_tokens", "logit_bias", "bad_words", "allowed_token_ids", "response_format",
              "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
              "tool_choice", "parallel_tool_calls", "chat_template_kwargs"]

    @settings(max_examples=MUTATIONS, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(sorted(valid)), field=st.sampled_from(fields), value=values)
    def mutate(path, field, value):
        import json

        body = {**valid[path], field: value}
        content = json.dumps(body, allow_nan=True)   # NaN/Infinity literals, as some clients send them
        _record(statuses, failures, f"POST {path} {field}={value!r}",
                httpx.post(base + path, content=content, headers={"content-type": "application/json"},
                           timeout=60))
    mutate()

    total = sum(statuses.values())
    print(f"fuzzed {total} requests: {dict(sorted(statuses.items()))}")
    assert not failures, f"{len(failures)} responses >= 500:\n" + "\n".join(failures[:20])
    assert total >= 650 * SCALE, statuses
    assert not failures, f"{len(failures)} responses >= 500:\n" + "\n".join(failures[:20])
    stats = fuzz_server.wait_idle()
    assert stats["kv_blocks_used"] == 0, stats
    answer = httpx.post(base + "/v1/completions", timeout=60, json={
        "model": fuzz_server.model_id, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}).json()
    assert fuzz_server.reference[PROMPTS[0]].startswith(answer["choices"][0]["text"])
