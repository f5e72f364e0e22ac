"""Greedy tokens of the engine equal HF generate (fp32) for concurrent requests of mixed lengths, also with
chunked prefill and with preemption forced by a small memory budget."""
import pytest

from elastic_hf import ElasticModel
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 12


def _check(model: ElasticModel, reference, prompts, max_new=MAX_NEW):
    outputs = model.generate(prompts, max_tokens=max_new)
    for prompt, out in zip(prompts, outputs):
        expected = hf_greedy(reference, prompt, max_new)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(prompt)} tokens diverged"
    return outputs


def test_tiny_model_under_forced_preemption(tiny_checkpoint):
    from elastic_hf.model.loader import load_hf_model

    path = tiny_checkpoint("llama")
    reference, _ = load_hf_model(path)
    probe = ElasticModel.from_pretrained(path, kv_cache_memory=1 << 20)
    block_bytes = probe.memory_report()["kv_block_bytes"]
    weights = probe.memory_report()["weights_bytes"]
    # 14 blocks of 16 tokens for 8 requests that need 4-8 blocks each: the scheduler must preempt.
    model = ElasticModel.from_pretrained(path, memory_budget=weights + 14 * block_bytes, max_model_len=128)
    prompts = mixed_prompts(model.tokenizer, 8, 40, 90, seed=2)
    _check(model, reference, prompts, max_new=24)
    stats = model.engine.stats()
    assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_used"] == 0


@pytest.mark.slow
def test_default_model_matches_hf(default_model, default_reference):
    prompts = mixed_prompts(default_model.tokenizer, 8, 5, 120, seed=3)
    _check(default_model, default_reference, prompts)


def test_windowed_decode_between_plain_decodes_matches_hf(tiny_checkpoint):
    """Mistral's 24-token window: a sequence past the window decodes with its own mask while shorter neighbours
    share the batched decode call; the packing must keep those neighbours contiguous."""
    from elastic_hf.model.loader import load_hf_model

    path = tiny_checkpoint("mistral")
    reference, _ = load_hf_model(path)
    model = ElasticModel.from_pretrained(path, kv_cache_memory=16 << 20)
    prompts = [list(range(100, 105)), list(range(200, 240)), list(range(300, 305))]
    _check(model, reference, prompts, max_new=8)
