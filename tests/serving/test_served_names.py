"""vLLM's --served-model-name with several names, through the real openai client: /v1/models lists each, a
request may name any of them and its response names the one it asked for, another name is a 404 naming them all;
and the server flags for Hub models (revision, download dir, tokenizer, trust-remote-code, generation config)
reach the engine's config."""
from __future__ import annotations

import argparse

import openai
import pytest

from serving_helpers import tiny_model_server

NAMES = ("org/tiny", "tiny-alias")


@pytest.fixture(scope="module")
def aliased_server(serving_checkpoint):
    with tiny_model_server(serving_checkpoint, served_model_name=NAMES) as handle:
        yield handle


def test_every_served_name_is_listed_and_answered(aliased_server):
    client = openai.OpenAI(base_url=aliased_server.base_url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        out = client.completions.create(model=name, prompt="Hello", max_tokens=3, temperature=0)
        assert out.model == name and out.choices[0].text
    with pytest.raises(openai.NotFoundError, match="'org/tiny' or 'tiny-alias'"):
        client.completions.create(model="other", prompt="Hello", max_tokens=3)


def test_hub_flags_reach_the_engine_config(tmp_path):
    from elastic_hf.serving import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.add_arguments(parser)
    args = parser.parse_args(["org/name", "--revision", "v2", "--download-dir", str(tmp_path), "--tokenizer",
                              "org/tok", "--trust-remote-code", "--generation-config", "vllm", "--hf-token", "t",
                              "--served-model-name", "a", "b", "--dtype", "half"])
    config = serve_cmd.engine_config(args)
    assert (config.model, config.revision, config.download_dir, config.tokenizer, config.trust_remote_code,
            config.generation_config, config.hf_token, config.dtype) == \
        ("org/name", "v2", str(tmp_path), "org/tok", True, "vllm", "t", "float16")
    assert args.served_model_name == ["a", "b"]
    defaults = serve_cmd.engine_config(parser.parse_args([]))
    assert (defaults.trust_remote_code, defaults.generation_config, defaults.dtype) == (False, "auto", "auto")
