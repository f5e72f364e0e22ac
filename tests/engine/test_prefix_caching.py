"""Prefix caching through the engine on tiny random-weight models: greedy tokens with the cache equal those without
it (multi-turn conversations whose turns extend the previous ones, chunked prefill, n = 2, forced preemption, a
precision morph between turns), and the cached-token counts are exactly the full blocks the previous turns
computed."""
import pytest

from elastic_hf import ElasticModel
from greedy_reference import mixed_prompts
from morph.morph_helpers import tiny_morph_model

BLOCK = 16
MAX_NEW = 8


def _greedy(model, prompts, max_new=MAX_NEW, **params):
    """(token ids of every choice of every prompt, cached prompt tokens of every prompt)."""
    outs = model.generate(prompts, max_tokens=max_new, ignore_eos=True, **params)
    return [[o.token_ids for o in out.outputs] for out in outs], [out.num_cached_tokens for out in outs]


def _conversation(model, turns):
    """Each turn's prompt is the previous prompt, its answer and the turn's tokens; returns (answers, cached)."""
    prompt, answers, cached = [], [], []
    for turn in turns:
        prompt = prompt + turn
        (choices,), (hit,) = _greedy(model, [prompt])
        answers.append(choices[0])
        cached.append(hit)
        prompt = prompt + choices[0]
    return answers, cached


def _expected_cached(turns):
    """Full blocks whose KV the previous turn computed (its answer's last token never is), and never the new
    prompt's last token (its logits are needed)."""
    out, prompt_len, computed = [], 0, 0
    for turn in turns:
        prompt_len += len(turn)
        out.append(min(computed, prompt_len - 1) // BLOCK * BLOCK)
        computed = prompt_len + MAX_NEW - 1
        prompt_len += MAX_NEW
    return out


@pytest.mark.parametrize("arch,budget", [("llama", 512), ("qwen2", 24)])   # qwen2: chunked prefill
def test_multi_turn_answers_with_the_cache_equal_those_without(arch, budget, tiny_checkpoint):
    path = tiny_checkpoint(arch)
    options = dict(kv_cache_memory=8 << 20, max_num_batched_tokens=budget)
    with ElasticModel.from_pretrained(path, enable_prefix_caching=False, **options) as plain, \
            ElasticModel.from_pretrained(path, **options) as model:
        turns = mixed_prompts(model.tokenizer, 4, 9, 40, seed=5)
        want, no_hits = _conversation(plain, turns)
        got, cached = _conversation(model, turns)
        assert got == want and no_hits == [0] * len(turns)
        assert cached == _expected_cached(turns) and cached[-1] > 0
        report = model.memory_report()["prefix_cache"]
        assert report["enabled"] and report["hit_tokens"] == sum(cached) and report["blocks"] > 0
        assert 0 < report["hit_rate"] < 1 and not plain.memory_report()["prefix_cache"]["enabled"]


def test_n2_preemption_and_concurrent_sharers_keep_the_greedy_tokens(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with ElasticModel.from_pretrained(path, kv_cache_memory=1 << 20) as probe:
        report = probe.memory_report()
        weights, block_bytes = report["weights_bytes"], report["kv_block_bytes"]
        system = mixed_prompts(probe.tokenizer, 1, 80, 80, seed=6)[0]             # 5 blocks everyone shares
        prompts = [system + p for p in mixed_prompts(probe.tokenizer, 8, 5, 30, seed=7)]
    # 24 blocks for 8 requests of 6-8 blocks each: preemption, and re-admission through the cache.
    small = dict(memory_budget=weights + 24 * block_bytes, max_model_len=160)
    with ElasticModel.from_pretrained(path, enable_prefix_caching=False, **small) as plain, \
            ElasticModel.from_pretrained(path, **small) as model:
        want, _ = _greedy(plain, prompts, 24)
        got, cached = _greedy(model, prompts, 24)
        assert got == want and max(cached) >= 80 // BLOCK * BLOCK
        assert model.engine.stats()["num_preemptions"] > 0 and model.memory_report()["kv_blocks_used"] == 0
        want, _ = _greedy(plain, prompts[:2], 24, n=2)
        got, cached = _greedy(model, prompts[:2], 24, n=2)   # both siblings from the cached prompt
        assert got == want and all(c >= 80 // BLOCK * BLOCK for c in cached)
        fresh = mixed_prompts(model.tokenizer, 1, 60, 60, seed=9)[0]   # seen by neither: the siblings share it
        before = model.engine.num_computed_prompt_tokens
        got, cached = _greedy(model, [fresh], 8, n=2)
        assert got == _greedy(plain, [fresh], 8, n=2)[0] and cached == [(len(fresh) - 1) // BLOCK * BLOCK]
        assert model.engine.num_computed_prompt_tokens - before == 2 * len(fresh) - cached[0]


def test_a_morph_between_turns_starts_a_new_cache_epoch(tiny_checkpoint):
    """The chosen policy: KV that other weights computed is never reused, so the outputs stay those of a model
    without a cache; after the swap the cache fills again."""
    path = tiny_checkpoint("llama")
    plain = tiny_morph_model(path, kv_cache_memory=8 << 20, enable_prefix_caching=False)
    model = tiny_morph_model(path, kv_cache_memory=8 << 20)
    t1, t2, t3 = mixed_prompts(model.tokenizer, 3, 20, 30, seed=8)
    (a1,), _ = _greedy(model, [t1])
    assert [a1] == _greedy(plain, [t1])[0]
    for m in (model, plain):
        m.morph.to_precision([0, 2], "w8")
    p2 = t1 + a1[0] + t2
    (a2,), (hit,) = _greedy(model, [p2])
    assert [a2] == _greedy(plain, [p2])[0] and hit == 0       # turn 1's blocks were computed by fp layers
    p3 = p2 + a2[0] + t3
    (a3,), (hit,) = _greedy(model, [p3])
    assert [a3] == _greedy(plain, [p3])[0]
    assert hit == (len(p2) + MAX_NEW - 1) // BLOCK * BLOCK   # the new epoch caches again
    assert model.reset_prefix_cache() > 0
    assert _greedy(model, [p3])[1] == [0]
