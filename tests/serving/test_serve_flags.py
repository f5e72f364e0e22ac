"""`elastic-hf serve` flags under vLLM's names map onto the one EngineConfig, and the request limits they set are
400s through the real openai client that touch no other request. --seed reproduces sampled outputs across
restarts, --chat-template replaces the model's template (a bad one is a startup error), --dtype auto picks bf16
only where the hardware computes it natively, and --morph-profile is the LIS profile (--profile its deprecated
alias)."""
import argparse
import subprocess
import sys

import httpx
import pytest

from elastic_hf.serving import serve_cmd
from serving_helpers import start_server


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
    config = _config("--device", "cuda", "--enforce-eager")
    assert (config.device, config.enforce_eager, config.dtype) == ("cuda", True, "auto")
    assert _config().device == "cpu" and _config().enforce_eager is False
    assert _config().rebalance_queues is True and _config("--no-rebalance-queues").rebalance_queues is False
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


def test_seed_flag_maps_onto_the_config():
    from elastic_hf.config import EngineConfig

    assert _config("--seed", "7").seed == 7 and _config().seed is None
    with pytest.raises(ValueError, match="seed must be an integer, got 'x'"):
        EngineConfig(seed="x")


def _sampled_texts(checkpoint: str, *argv: str) -> tuple[list[str], str]:
    """Texts of three temperature-1 completions (the third repeats the first prompt) without a seed of their own,
    then one with seed 77, from a fresh server started with `argv`."""
    from elastic_hf import ElasticModel

    with ElasticModel.from_config(_config(checkpoint, "--max-model-len", "128", "--kv-cache-memory", "16MiB",
                                          *argv)) as model:
        server, stop = start_server(model)
        try:
            def complete(prompt: str, **extra) -> str:
                body = {"model": server.model_id, "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
                        "ignore_eos": True, **extra}
                resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
                assert resp.status_code == 200, resp.text
                return resp.json()["choices"][0]["text"]

            texts = [complete(prompt) for prompt in ("Once upon a time", "The capital of", "Once upon a time")]
            return texts, complete("Once upon a time", seed=77)
        finally:
            stop()


def test_same_seed_reproduces_sampled_outputs_after_a_restart(serving_checkpoint):
    first, own_first = _sampled_texts(serving_checkpoint, "--seed", "1234")
    again, own_again = _sampled_texts(serving_checkpoint, "--seed", "1234")
    unseeded, own_unseeded = _sampled_texts(serving_checkpoint)
    assert first == again, "the same requests to a server restarted with the same --seed sampled differently"
    assert first[0] != first[2], "each accepted request gets its own seed, not the server's"
    assert unseeded != first, "without --seed the sampled outputs should differ from run to run"
    assert own_first == own_again == own_unseeded, "a request's own seed wins over the server's"


def test_chat_template_from_a_file_replaces_the_models(serving_checkpoint, tmp_path):
    from elastic_hf import ElasticModel
    from elastic_hf.config import load_chat_template

    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    assert load_chat_template("{{ 'x' }}\\n") == "{{ 'x' }}\n"   # inline, its escapes decoded as vLLM does
    config = _config(serving_checkpoint, "--chat-template", str(path), "--max-model-len", "128",
                     "--kv-cache-memory", "16MiB")
    assert config.chat_template == str(path)
    with ElasticModel.from_config(config) as model:
        server, stop = start_server(model)
        try:
            messages = [{"role": "user", "content": "Hi there"}]
            tokens = httpx.post(server.base_url + "/tokenize", json={"messages": messages}, timeout=30).json()
            text = httpx.post(server.base_url + "/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
            assert text["prompt"] == "<user>Hi there<assistant>"
            chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                              json={"model": server.model_id, "messages": messages, "max_tokens": 2})
            assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == tokens["count"]
        finally:
            stop()


def test_bad_chat_template_is_a_startup_error(serving_checkpoint, tmp_path):
    for template, needle in ((str(tmp_path / "missing.jinja"), "looks like a file path but cannot be read"),
                             ("{% for m in messages %}{{ m['content'] }}", "chat_template is not valid Jinja")):
        result = subprocess.run([sys.executable, "-m", "elastic_hf.serving.serve_cmd", serving_checkpoint,
                                 "--chat-template", template, "--max-model-len", "128"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 2, result.stderr
        assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_dtype_auto_is_bf16_only_where_the_hardware_computes_it(tmp_path):
    """What auto means for a GGUF file (no float dtype of its own): bf16 only where the device computes it natively.
    A checkpoint's auto is its own dtype (tests/model/test_dtypes.py); the config keeps "auto" until the model is
    resolved."""
    from elastic_hf.config import EngineConfig, auto_dtype, read_cpu_flags

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert {"avx2", "avx512_bf16"} <= read_cpu_flags(str(cpuinfo))
    assert read_cpu_flags(str(tmp_path / "absent")) == set()   # not Linux: float32, the safe choice
    assert auto_dtype("cpu", {"avx2", "avx512f"})[0] == "float32"
    assert auto_dtype("cpu", {"avx512_bf16"})[0] == auto_dtype("cpu", {"amx_bf16"})[0] == "bfloat16"
    assert auto_dtype("cuda:1", set())[0] == "bfloat16"
    assert EngineConfig(dtype="auto", device="cuda").dtype == "auto" == _config().dtype   # the default is auto
    for spelled, canonical in (("half", "float16"), ("float", "float32"), ("bf16", "bfloat16")):   # vLLM's names
        assert EngineConfig(dtype=spelled).dtype == canonical

def test_morph_profile_flag_and_its_deprecated_alias(tmp_path, capsys):
    profile = tmp_path / "lis.json"
    profile.write_text("{}")
    assert _config("--morph", "manual", "--morph-profile", str(profile)).morph.profile == str(profile)
    assert "deprecated" not in capsys.readouterr().err
    assert _config("--morph", "manual", "--profile", str(profile)).morph.profile == str(profile)
    err = capsys.readouterr().err
    assert "--profile is deprecated" in err and f"--morph-profile {profile}" in err
    with pytest.raises(ValueError, match="--morph-profile alone"):
        _config("--morph-profile", str(profile), "--profile", str(profile))
