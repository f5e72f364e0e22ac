"""/metrics under vLLM's names (`vllm:*` with the labels model_name = the served model name and engine), next to
ours (`elastic_hf_*`, with the e2e latency histogram): scraped over real HTTP after real requests through a real
server, the counts match the requests just made; the gauges of a multi-instance deployment are deployment-wide."""
from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving_helpers import PROMPTS, TINY_MAX_MODEL_LEN, start_server

SERVED = "tiny-served-name"
LABELS = {"model_name": SERVED, "engine": "0"}


@pytest.fixture(scope="module")
def named_server(serving_checkpoint):
    """A server whose served name differs from the model id: the model_name label must say the served one."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=64 << 20)
    assert model.model_id != SERVED
    handle, stop = start_server(model, served_model_name=SERVED)
    yield handle
    stop()
    model.close()


def scrape(server) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics: (name, labels) -> value."""
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset({**LABELS, **labels}.items()) if name.startswith("vllm:")
                    else frozenset(labels.items()))]


def grew(before: dict, after: dict, name: str, **labels) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


def _complete(server, prompt: str, max_tokens: int) -> dict:
    body = {"model": server.model_id, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_vllm_names_count_finished_requests_under_the_served_name(named_server):
    before = scrape(named_server)
    responses = [_complete(named_server, prompt, 4) for prompt in PROMPTS[:3]]
    named_server.wait_idle()
    after = scrape(named_server)
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in responses)
    assert all(r["choices"][0]["finish_reason"] == "length" for r in responses)

    assert grew(before, after, "vllm:request_success_total", finished_reason="length") == 3
    for reason in ("stop", "abort", "error"):   # exported from the start, as vLLM does
        assert grew(before, after, "vllm:request_success_total", finished_reason=reason) == 0
    assert grew(before, after, "vllm:e2e_request_latency_seconds_count") == 3
    assert grew(before, after, "elastic_hf_e2e_request_latency_seconds_count") == 3
    assert grew(before, after, "elastic_hf_requests_finished_total", finish_reason="length") == 3
    assert grew(before, after, "vllm:prompt_tokens_total") == prompt_tokens
    assert grew(before, after, "vllm:generation_tokens_total") == 12
    assert grew(before, after, "vllm:time_to_first_token_seconds_count") == 3
    assert grew(before, after, "vllm:inter_token_latency_seconds_count") == 9   # 3 gaps between 4 tokens each
    for name in ("request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens",
                 "request_params_n"):
        assert grew(before, after, f"vllm:{name}_count") == 3, name
    assert grew(before, after, "vllm:request_prompt_tokens_sum") == prompt_tokens
    assert grew(before, after, "vllm:request_generation_tokens_sum") == 12
    assert grew(before, after, "vllm:request_params_max_tokens_sum") == 12
    # e2e covers queue + inference; every request took some time
    assert grew(before, after, "vllm:e2e_request_latency_seconds_sum") >= \
        grew(before, after, "vllm:request_inference_time_seconds_sum") > 0
    # vLLM's buckets: token counts in 1-2-5 steps up to max_model_len, latencies up to 7680 s
    assert ("vllm:request_prompt_tokens_bucket", frozenset({**LABELS, "le": "1000.0"}.items())) in after
    assert ("vllm:e2e_request_latency_seconds_bucket", frozenset({**LABELS, "le": "7680.0"}.items())) in after
    # idle: nothing running or waiting, no KV block in use
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert value(after, name) == 0, name
    assert value(after, "vllm:num_preemptions_total") == 0
    # every vLLM series names the served model, none the checkpoint's id
    names = {dict(labels).get("model_name") for (name, labels) in after if name.startswith("vllm:")}
    assert names == {SERVED}


def test_aborted_request_counts_as_abort_with_its_latency(named_server):
    before = scrape(named_server)
    body = {"model": named_server.model_id, "prompt": PROMPTS[1], "max_tokens": TINY_MAX_MODEL_LEN - 100,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", named_server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        during = scrape(named_server)   # decoding: one request running, its KV blocks in use
        stats = named_server.stats()
    assert value(during, "vllm:num_requests_running") == 1
    usage = value(during, "vllm:kv_cache_usage_perc")
    assert 0 < usage <= 1
    assert usage == pytest.approx(value(during, "elastic_hf_kv_blocks_used") / stats["kv_blocks_total"])
    named_server.wait_idle()
    after = scrape(named_server)
    assert grew(before, after, "vllm:request_success_total", finished_reason="abort") == 1, \
        "the request was not aborted (it ran to its end?)"
    assert grew(before, after, "vllm:request_success_total", finished_reason="length") == 0
    assert grew(before, after, "vllm:e2e_request_latency_seconds_count") == 1
    assert grew(before, after, "elastic_hf_e2e_request_latency_seconds_count") == 1
    assert grew(before, after, "vllm:e2e_request_latency_seconds_sum") > 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0


def test_gauges_of_a_deployment_cover_every_instance(tiny_checkpoint):
    """Two TP-1 instances share one metrics object: kv_cache_usage_perc is used / total over both, and the
    queue gauges count both, whichever instance's engine updated them last."""
    from elastic_hf import ElasticModel
    from elastic_hf.engine.sampling_params import SamplingParams

    with ElasticModel.from_pretrained(tiny_checkpoint("llama"), workers=2, kv_cache_memory=4 << 20,
                                      max_model_len=256) as model:
        dep = model.deployment
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        dep.add_request("a", list(range(5, 100)), params, instance=0)
        dep.add_request("b", [5, 6, 7], params, instance=1)
        dep.step()
        samples = {(s.name, frozenset(s.labels.items())): s.value
                   for family in text_string_to_metric_families(dep.metrics.render().decode())
                   for s in family.samples}
        labels = frozenset({"model_name": model.model_id, "engine": "0"}.items())
        allocators = [inst.engine.scheduler.kv for inst in dep.instances]
        used, total = sum(a.num_used for a in allocators), sum(a.num_total for a in allocators)
        assert len(allocators) == 2 and all(a.num_used for a in allocators)
        assert samples[("vllm:kv_cache_usage_perc", labels)] == pytest.approx(used / total)
        assert samples[("vllm:num_requests_running", labels)] == 2
        assert samples[("elastic_hf_kv_blocks_total", frozenset())] == total
        for request_id in ("a", "b"):
            dep.abort_request(request_id)


def test_set_model_name_relabels_before_serving():
    from elastic_hf.engine.metrics import EngineMetrics

    metrics = EngineMetrics("org/checkpoint", max_model_len=100)
    metrics.set_model_name("served")
    metrics.on_generation_tokens(3)
    text = metrics.render().decode()
    assert 'vllm:generation_tokens_total{engine="0",model_name="served"} 3.0' in text
    assert 'model_name="org/checkpoint"' not in text
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="100.0",model_name="served"}' in text
    assert 'le="200.0",model_name="served"' not in text   # buckets stop at max_model_len, as vLLM's
