import os

import pytest


def pytest_collection_modifyitems(config, items):
    # The standalone copy (tests/test_standalone.py re-runs the suite in a clean copy) checks that the repository
    # stands on its own, i.e. which files a run reads. Stress tests (fault drills, drains, the soak) exercise runtime
    # behaviour over code and files the rest of the suite reads too, and `outer_only` tests repeat a path tested
    # elsewhere in another dtype or layout; running them twice would cost minutes of CI.
    if os.environ.get("ELASTIC_HF_STANDALONE_CLONE"):
        skip_outer = pytest.mark.skip(reason="runs in the outer run only, not in the standalone copy")
        for item in items:
            if "stress" in item.keywords or "outer_only" in item.keywords:
                item.add_marker(skip_outer)
    # GPU tests run only on device machines; elsewhere they skip instead of failing on a missing CUDA.
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint("llama" | "qwen2" | "mistral") -> checkpoint dir, built once per session."""
    from tiny_models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny-models")
    return lambda arch: build_tiny_checkpoint(arch, root / arch)


@pytest.fixture(scope="session")
def tiny_llama():
    """tiny_llama(num_layers=4, seed=0) -> an in-memory random-weight Llama (hidden 64, GQA 4/2 heads, vocab 512)."""
    from tiny_models import tiny_hf_model

    return lambda num_layers=4, seed=0: tiny_hf_model(
        "llama", seed, num_hidden_layers=num_layers, vocab_size=512, max_position_embeddings=512,
        tie_word_embeddings=True, initializer_range=0.1)


@pytest.fixture(scope="session")
def default_model():
    """The embedded SmolLM2-135M-Instruct as an ElasticModel, shared by the tests that need a real model."""
    from elastic_hf import ElasticModel

    return ElasticModel.from_pretrained(kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def default_reference(default_model):
    """The untouched HF model of the same checkpoint (sdpa attention), for greedy-equality references."""
    from elastic_hf.model.loader import load_hf_model

    model, _ = load_hf_model(default_model.checkpoint_dir)
    return model
