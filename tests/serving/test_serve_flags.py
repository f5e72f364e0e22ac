"""`elastic-hf serve` flags under vLLM's names map onto the one EngineConfig, and the request limits they set are
400s through the real openai client that touch no other request."""
import argparse

import pytest

from elastic_hf.serving import serve_cmd


def _config(*argv):
    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    return serve_cmd.engine_config(parser.parse_args(list(argv)))


def test_vllm_flag_names_map_onto_the_config():
    assert _config("--workers", "2", "-tp", "2").topology == (2,)
    assert _config("--workers", "2", "--tensor-parallel-size", "2").topology == (2,)
    assert _config("--kv-cache-memory-bytes", "64MiB").kv_cache_memory == 64 << 20
    assert _config("--gpu-memory-utilization", "0.5").memory_budget == "0.5"
    config = _config("--block-size", "32", "--max-stop-strings", "4", "--max-stop-string-chars", "8")
    assert (config.block_size, config.max_stop_strings, config.max_stop_string_chars) == (32, 4, 8)
    with pytest.raises(ValueError, match="not both"):
        _config("--gpu-memory-utilization", "0.5", "--memory-budget", "1GiB")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        _config("--gpu-memory-utilization", "1.5")
    with pytest.raises(ValueError, match="max_stop_strings must be an integer >= 1"):
        _config("--max-stop-strings", "0")


def test_stop_string_limits_are_400s_and_other_requests_go_on(tiny_server):
    import openai

    client = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key=tiny_server.api_key)
    limits = tiny_server.model.config
    with pytest.raises(openai.BadRequestError, match=f"at most {limits.max_stop_strings} stop strings"):
        client.completions.create(model=tiny_server.model_id, prompt="Hi", max_tokens=2,
                                  stop=[f"s{i}" for i in range(limits.max_stop_strings + 1)])
    with pytest.raises(openai.BadRequestError, match="at most 1024 characters"):
        client.chat.completions.create(model=tiny_server.model_id, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, stop=["x" * (limits.max_stop_string_chars + 1)])
    ok = client.completions.create(model=tiny_server.model_id, prompt="Hi", max_tokens=2,
                                   stop=[f"s{i}" for i in range(limits.max_stop_strings)])
    assert ok.choices[0].finish_reason in ("length", "stop")


def test_a_full_queue_refuses_new_requests_with_503_and_retry_after(tiny_checkpoint):
    from elastic_hf import ElasticModel
    from elastic_hf.engine.errors import EngineOverloaded
    from elastic_hf.engine.sampling_params import SamplingParams
    from elastic_hf.serving.errors import api_error_from_engine

    assert _config("--max-queued-requests", "3").max_queued_requests == 3
    with ElasticModel.from_pretrained(tiny_checkpoint("llama"), kv_cache_memory=1 << 20,
                                      max_queued_requests=3) as model:
        dep = model.deployment
        params = SamplingParams(temperature=0.0, max_tokens=4)
        ids = [dep.add_request(None, [5, 6, 7], params) for _ in range(3)]   # queued: no step has run
        with pytest.raises(EngineOverloaded, match="3 sequences are queued and max_queued_requests is 3"):
            dep.add_request(None, [5, 6, 7], params)
        error = api_error_from_engine(EngineOverloaded("full"))
        response = error.response()
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        while dep.has_unfinished_requests():   # the queued ones are untouched and finish
            dep.step()
        assert dep.add_request(None, [5, 6, 7], params) not in ids   # room again
