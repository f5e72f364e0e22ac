"""Fixtures of the serving tests: real uvicorn servers over real ElasticModels (see serving_helpers.py)."""
from __future__ import annotations

import pytest

from serving_helpers import API_KEY, PROMPTS, TINY_MAX_MODEL_LEN, start_server


@pytest.fixture(scope="session")
def serving_checkpoint(tiny_checkpoint):
    """The tiny random-weight Llama (with the default model's real tokenizer) that most serving tests use."""
    return str(tiny_checkpoint("llama"))


@pytest.fixture(scope="session")
def tiny_server(serving_checkpoint):
    """One server over the tiny model for the whole session, with an API key (auth is part of every test)."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(serving_checkpoint, max_model_len=TINY_MAX_MODEL_LEN,
                                         kv_cache_memory=64 << 20, max_num_seqs=64, max_num_batched_tokens=512)
    handle, stop = start_server(model, api_key=API_KEY, prompts=PROMPTS, chats=["Hi there!", "Tell me a joke."])
    yield handle
    stop()


@pytest.fixture(scope="session")
def default_server():
    """The embedded SmolLM2-135M-Instruct, for quality and log-probability checks through the real client (one per
    session: loading it and computing its references takes seconds)."""
    from elastic_hf import ElasticModel

    model = ElasticModel.from_pretrained(None, max_model_len=2048, kv_cache_memory=256 << 20, dtype="float32")
    handle, stop = start_server(model, prompts=["The capital of France is"], tool_parser="hermes",
                                reasoning_parser="qwen3",
                                chats=["What is the capital of France? Answer in one word."])
    yield handle
    stop()
