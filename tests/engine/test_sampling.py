"""Sampling options through the engine on a tiny Llama: seeds, top-k/top-p/temperature, repetition penalty
(against HF generate), stop strings, stop token ids, max_tokens, n > 1, and argument validation."""
import pytest

from elastic_hf import ElasticModel, RequestOutputKind, SamplingParams
from greedy_reference import mixed_prompts


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from elastic_hf.model.loader import load_hf_model

    path = tiny_checkpoint("llama")
    reference, _ = load_hf_model(path)
    return ElasticModel.from_pretrained(path, kv_cache_memory=32 << 20), reference


@pytest.fixture(scope="module")
def prompts(tiny):
    return mixed_prompts(tiny[0].tokenizer, 6, 4, 30, seed=5)


def test_same_seed_same_output_different_seed_differs(tiny, prompts):
    model, _ = tiny
    kw = dict(max_tokens=16, temperature=1.0, seed=1234)
    a = model.generate(prompts, **kw)
    b = model.generate(prompts[::-1], **kw)[::-1]  # different batch neighbours and order
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    c = model.generate(prompts, **{**kw, "seed": 99})
    assert [o.outputs[0].token_ids for o in a] != [o.outputs[0].token_ids for o in c]


def test_top_k_one_is_greedy(tiny, prompts):
    model, _ = tiny
    greedy = model.generate(prompts, max_tokens=10)
    top1 = model.generate(prompts, max_tokens=10, temperature=0.8, top_k=1, seed=3)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in top1]


def test_tiny_top_p_is_greedy(tiny, prompts):
    model, _ = tiny
    greedy = model.generate(prompts, max_tokens=10)
    nucleus = model.generate(prompts, max_tokens=10, temperature=1.0, top_p=1e-6, seed=3)
    assert [o.outputs[0].token_ids for o in greedy] == [o.outputs[0].token_ids for o in nucleus]


@pytest.mark.slow
def test_repetition_penalty_matches_hf(default_model, default_reference):
    import torch

    # A looping prompt: the plain greedy continuation repeats itself, the penalised one must not.
    prompt = default_model.tokenizer.encode("one two one two one two one two one two one two")
    out = default_model.generate(prompt, max_tokens=8, repetition_penalty=1.8).outputs[0]
    plain = default_model.generate(prompt, max_tokens=8).outputs[0]
    ids = torch.tensor([prompt])
    ref = default_reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                     do_sample=False, repetition_penalty=1.8)[0, len(prompt):].tolist()
    assert out.token_ids == ref[:len(out.token_ids)]
    assert out.token_ids != plain.token_ids


def test_n_sequences_share_prompt_and_differ(tiny, prompts):
    model, _ = tiny
    out = model.generate(prompts[0], max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = model.generate(prompts[0], max_tokens=12, temperature=1.0, n=3, seed=7)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_max_tokens_and_stop_token_ids(tiny, prompts):
    model, _ = tiny
    full = model.generate(prompts[1], max_tokens=12).outputs[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    stop_at = full.token_ids[5]
    first = full.token_ids.index(stop_at)
    cut = model.generate(prompts[1], max_tokens=12, stop_token_ids=[stop_at]).outputs[0]
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[:first]


def test_stop_string_truncates_text(tiny, prompts):
    model, _ = tiny
    full = model.generate(prompts[2], max_tokens=16).outputs[0]
    text = full.text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    out = model.generate(prompts[2], max_tokens=16, stop=[stop]).outputs[0]
    assert out.finish_reason == "stop" and out.text == text[:text.index(stop)]
    kept = model.generate(prompts[2], max_tokens=16, stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == text[:text.index(stop) + len(stop)]


def test_stream_deltas_add_up(tiny, prompts):
    model, _ = tiny
    final = model.generate(prompts[3], max_tokens=10).outputs[0]
    deltas = list(model.stream(prompts[3], max_tokens=10))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    assert "".join(d.outputs[0].delta_text for d in deltas) == final.text
    assert sum((d.outputs[0].delta_token_ids for d in deltas), []) == final.token_ids


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds_carry_the_same_completions(tiny, prompts, kind):
    """CUMULATIVE repeats the output so far, DELTA sends only what is new, FINAL_ONLY one output at the end: the
    completions they add up to are the same (text with a stop string held back, token ids, log-probabilities)."""
    model, _ = tiny
    sampling = dict(max_tokens=14, n=2, temperature=0.9, seed=11, logprobs=2)
    unstopped = model.generate(prompts[4], **sampling).outputs[0].text
    middle = len(unstopped) // 2
    sampling["stop"] = [unstopped[middle:middle + 3]] if len(unstopped) > 12 else []
    final = model.generate(prompts[4], **sampling)   # generate returns the final output only
    outs = list(model.stream(prompts[4], SamplingParams(**sampling, output_kind=kind)))
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    if kind is RequestOutputKind.FINAL_ONLY:
        assert len(outs) == 1
    else:
        assert len(outs) > 3   # one per step (a held-back stop string may merge a few)
    for index, expected in enumerate(final.outputs):
        mine = [o.outputs[index] for o in outs]
        assert "".join(c.delta_text for c in mine) == expected.text
        assert sum((c.delta_token_ids for c in mine), []) == expected.token_ids
        assert [lp.token_id for c in mine for lp in c.delta_logprobs] == expected.token_ids
        if kind is RequestOutputKind.DELTA:   # the main fields hold the delta too, never the whole output
            assert all(c.text == c.delta_text and c.token_ids == c.delta_token_ids for c in mine)
            assert all(len(c.token_ids) <= 1 for c in mine)   # one token a step
        else:   # the last output holds everything
            assert (mine[-1].text, mine[-1].token_ids) == (expected.text, expected.token_ids)
            assert [lp.token_id for lp in mine[-1].logprobs] == expected.token_ids
        if kind is RequestOutputKind.CUMULATIVE:
            assert all(expected.text.startswith(c.text) for c in mine)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(temperature=-0.5), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(repetition_penalty=0), "repetition_penalty must be >= 0.0001"),
    (dict(repetition_penalty=2.2e-308), "repetition_penalty must be >= 0.0001"),
    (dict(output_kind="delta"), "output_kind must be a RequestOutputKind"),
])
def test_bad_sampling_params_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_prompt_too_long_names_both_numbers(tiny):
    model, _ = tiny
    limit = model.max_model_len
    with pytest.raises(ValueError, match=f"prompt has {limit + 5} tokens but max_model_len is {limit}"):
        model.generate([5] * (limit + 5), max_tokens=1)
    with pytest.raises(ValueError, match="prompt is empty"):
        model.generate([[]], max_tokens=1)
    assert model.engine.stats()["num_requests"] == 0  # nothing left behind


def test_greedy_argmax_has_torchs_semantics():
    """The native row argmax greedy rows take: the first maximum, the first NaN where a row has one, 0 for a row
    of -inf, strided rows, and torch's own answer for what the kernel does not take (bf16)."""
    import torch

    from elastic_hf.native.argmax import argmax_rows

    torch.manual_seed(0)
    logits = torch.randn(40, 49152)
    logits[1, 17] = logits[1, 30000] = 1e4                       # ties: the first
    logits[2, 40000] = float("nan")
    logits[2, 41000] = float("nan")
    logits[2, 5] = float("inf")                                   # NaN beats inf
    logits[3] = float("-inf")
    logits[4, -1] = 50.0                                          # the last column
    expected = logits.max(dim=-1).indices.tolist()
    assert expected[1] == 17 and expected[2] == 40000 and expected[3] == 0 and expected[4] == 49151
    assert argmax_rows(logits) == expected
    assert argmax_rows(logits[::3]) == expected[::3]               # rows at a stride
    assert argmax_rows(logits[:6, :1000]) == logits[:6, :1000].max(dim=-1).indices.tolist()   # part of each row
    assert argmax_rows(logits[5:9].bfloat16()) == logits[5:9].bfloat16().max(dim=-1).indices.tolist()
