"""Structured output and the sampling surface at the engine level, on the tiny random-weight Llama with the default
model's real tokenizer: constrained outputs match their constraint token for token (a fresh matcher accepts every
token), also with n > 1, sampling, log-probabilities and preemption; the grammar's mask, the processors (logit_bias,
allowed_token_ids, bad_words, penalties, min_tokens) do what they say; the mask kernel equals the torch path."""
import json
import re

import pytest
import torch

from elastic_hf import ElasticModel, SamplingParams
from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.grammar import interoperable_integers
from elastic_hf.engine.structured_outputs import StructuredOutputsParams as Constraint
import elastic_hf.native.token_bitmask as token_bitmask

ITEM = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"},
                                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["kind", "ok", "n"], "additionalProperties": False}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 2, "maxItems": 2}


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return ElasticModel.from_pretrained(str(tiny_checkpoint("llama")), max_model_len=512, kv_cache_memory=8 << 20)


def _accepted_by_fresh_matcher(model, constraint, token_ids) -> bool:
    state = model.deployment.input_processor.grammars.compile(constraint).state()
    return all(state.consume(t) for t in token_ids)


def _check_schema_output(text: str) -> bool:
    items = json.loads(text)
    assert isinstance(items, list) and len(items) == 2
    for item in items:
        assert list(item) == ["kind", "ok", "n"]   # the schema's property order
        assert item["kind"] in ("cat", "dog") and isinstance(item["ok"], bool) and 0 <= item["n"] <= 99
    return True


def test_each_kind_of_constraint_shapes_greedy_output(model):
    cases = [(Constraint(json=SCHEMA), _check_schema_output),
             (Constraint(regex=r"\d{3}-[a-z]{2}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2}", t)),
             (Constraint(choice=["alpha", "beta gamma"]), lambda t: t in ("alpha", "beta gamma")),
             (Constraint(grammar='root ::= "yes" | "no" | "maybe " [0-9]'),
              lambda t: re.fullmatch(r"yes|no|maybe [0-9]", t))]
    for constraint, check in cases:
        out = model.generate("Answer:", max_tokens=80, temperature=0.0, structured_outputs=constraint).outputs[0]
        assert out.finish_reason == "stop", (constraint, out.text)
        assert check(out.text), (constraint.kind, out.text)
        assert _accepted_by_fresh_matcher(model, constraint, out.token_ids)


def test_json_object_and_unbounded_integers_terminate(model):
    assert interoperable_integers({"type": "integer"}) == {"type": "integer", "minimum": -(2**53 - 1),
                                                           "maximum": 2**53 - 1}
    assert interoperable_integers({"type": ["integer", "null"], "minimum": 3})["maximum"] == 2**53 - 1
    out = model.generate("JSON:", max_tokens=200, temperature=0.0,
                         structured_outputs=Constraint(json={"type": "object", "properties": {
                             "a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}))
    assert out.outputs[0].finish_reason == "stop" and isinstance(json.loads(out.outputs[0].text)["a"], int)


def test_sampled_choices_logprobs_and_preemption_keep_the_constraint(model, tiny_checkpoint):
    report = model.memory_report()
    # 12 blocks (of 16 tokens) for 6 sequences of up to 4 blocks each: the scheduler must preempt and recompute
    small = ElasticModel.from_pretrained(str(tiny_checkpoint("llama")), max_model_len=72,
                                         memory_budget=report["weights_bytes"] + 12 * report["kv_block_bytes"])
    constraint = Constraint(json=SCHEMA)
    outs = small.generate(["Pets:" * k for k in range(1, 4)], max_tokens=56, temperature=1.0, seed=7, n=2,
                          logprobs=2, structured_outputs=constraint)
    assert small.deployment.stats()["num_preemptions"] > 0
    for out in outs:
        for o in out.outputs:
            assert o.finish_reason == "stop", o.text
            _check_schema_output(o.text)
            assert _accepted_by_fresh_matcher(small, constraint, o.token_ids)
            # log-probabilities are of the raw distribution: masked-out tokens still show among the alternatives
            assert len(o.logprobs) == len(o.token_ids) and all(lp.logprob <= 0 for lp in o.logprobs)
    small.close()


def test_invalid_constraints_are_refused_with_the_reason(model):
    for constraint, needle in [(Constraint(json={"type": 5}), "type"), (Constraint(regex="(("), "regex"),
                               (Constraint(grammar="root ::= missing"), "missing"),
                               (Constraint(json="{not json"), "json")]:
        with pytest.raises(InvalidRequest, match=needle):
            model.generate("x", max_tokens=4, structured_outputs=constraint)
    with pytest.raises(InvalidRequest, match="exactly one"):
        Constraint(regex="a", choice=["b"])
    assert model.generate("still serving", max_tokens=3, temperature=0.0).outputs[0].finish_reason == "length"


def test_processors_restrict_bias_and_penalise(model):
    greedy = model.generate("The cat sat on the", max_tokens=12, temperature=0.0).outputs[0].token_ids
    allowed = [greedy[1], greedy[2], 1000]
    out = model.generate("The cat sat on the", max_tokens=12, temperature=0.0, allowed_token_ids=allowed)
    assert set(out.outputs[0].token_ids) <= set(allowed)
    banned = model.generate("The cat sat on the", max_tokens=12, temperature=0.0, logit_bias={greedy[0]: -100})
    assert banned.outputs[0].token_ids[0] != greedy[0]
    forced = model.generate("The cat sat on the", max_tokens=4, temperature=0.0, logit_bias={1000: 100})
    assert forced.outputs[0].token_ids == [1000] * 4
    # presence/frequency penalties: a favoured token loses its lead once the output holds it often enough
    favoured = model.generate("The cat sat on the", max_tokens=12, temperature=0.0, logit_bias={1000: 10})
    assert favoured.outputs[0].token_ids == [1000] * 12
    penalised = model.generate("The cat sat on the", max_tokens=12, temperature=0.0, logit_bias={1000: 10},
                               presence_penalty=2.0, frequency_penalty=2.0)
    tokens = penalised.outputs[0].token_ids
    assert tokens[0] == 1000 and 1 <= tokens.count(1000) <= 4, tokens
    word = model.tokenizer.decode([greedy[0]]).strip()
    if word:
        no_word = model.generate("The cat sat on the", max_tokens=12, temperature=0.0, bad_words=[word])
        assert greedy[0] not in no_word.outputs[0].token_ids[:1]


def test_min_tokens_holds_back_eos_stop_tokens_and_stop_strings(model):
    free = model.generate("Count: 1, 2,", max_tokens=30, temperature=0.0).outputs[0]
    stop_token = free.token_ids[2]
    early = model.generate("Count: 1, 2,", max_tokens=30, temperature=0.0, stop_token_ids=[stop_token]).outputs[0]
    assert len(early.token_ids) <= 2
    held = model.generate("Count: 1, 2,", max_tokens=30, temperature=0.0, stop_token_ids=[stop_token],
                          min_tokens=10).outputs[0]
    assert len(held.token_ids) >= 10 and stop_token not in held.token_ids[:10]
    text = free.text
    stop = text[len(text) // 4:len(text) // 4 + 2]
    if stop.strip():
        cut = model.generate("Count: 1, 2,", max_tokens=30, temperature=0.0, stop=[stop]).outputs[0]
        kept = model.generate("Count: 1, 2,", max_tokens=30, temperature=0.0, stop=[stop], min_tokens=25).outputs[0]
        assert len(kept.token_ids) >= 25 > len(cut.token_ids)


def test_bitmask_kernel_equals_the_torch_path(monkeypatch):
    torch.manual_seed(0)
    vocab, rows = 49152 + 9, [0, 2, 3]
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, 49152 // 32), dtype=torch.int32)
    bitmask[:, :4] = 0
    bitmask[:, 4:8] = -1
    with torch.inference_mode():   # as the model makes them: inference tensors, masked outside that mode
        logits = torch.randn(5, vocab)
    native = logits.clone()
    token_bitmask.apply_token_bitmask(native, rows, bitmask)
    monkeypatch.setattr(token_bitmask, "_kernel", lambda: None)
    with torch.inference_mode():
        fallback = logits.clone()
    token_bitmask.apply_token_bitmask(fallback, rows, bitmask)
    assert torch.equal(native, fallback)
    assert torch.equal(native[1], logits[1]) and torch.equal(native[4], logits[4])   # rows without a mask
    word, bit = 100, 5
    allowed = bool((bitmask[0, word] >> bit) & 1)
    assert torch.isfinite(native[0, 32 * word + bit]).item() == allowed
    assert torch.isinf(native[0, 49152:]).all()   # beyond the mask's 32 W tokens


def test_sampling_params_validate_the_new_fields():
    for kwargs, needle in [({"presence_penalty": 3}, "presence_penalty"), ({"min_p": 1.5}, "min_p"),
                           ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
                           ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": {1: 200}}, "logit_bias"),
                           ({"allowed_token_ids": []}, "allowed_token_ids"), ({"bad_words": [""]}, "bad_words")]:
        with pytest.raises(InvalidRequest, match=needle):
            SamplingParams(**kwargs)
    assert SamplingParams(logit_bias={"5": -100}).logit_bias == {5: -100.0}


def test_top_k_top_p_keep_what_hf_keeps_and_draw_follows_the_distribution():
    from transformers import LogitsProcessorList, TopKLogitsWarper, TopPLogitsWarper

    from elastic_hf.engine.logits_processors import TopKTopPProcessor
    from elastic_hf.engine.batched_sampling import draw

    gen = torch.Generator().manual_seed(0)
    for trial in range(200):   # vocabularies beyond the 256 candidates too, so the full-sort fallback runs
        vocab = int(torch.randint(10, 3000, (1,), generator=gen))
        scores = torch.randn(1, vocab, generator=gen) * float(torch.rand(1, generator=gen) * 8)
        top_k = int(torch.randint(0, vocab + 5, (1,), generator=gen)) if trial % 3 else 0
        top_p = float(torch.rand(1, generator=gen)) if trial % 4 else 1.0
        hf = LogitsProcessorList(([TopKLogitsWarper(top_k)] if top_k else []) +
                                 ([TopPLogitsWarper(top_p)] if top_p < 1 else []))(None, scores.clone())
        ours = TopKTopPProcessor(top_k, top_p)(None, scores.clone())
        assert torch.equal(torch.isfinite(hf), torch.isfinite(ours)), (vocab, top_k, top_p)
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    counts = torch.bincount(torch.tensor([draw(probs, gen) for _ in range(20000)]), minlength=5) / 20000
    assert counts[1] == counts[4] == 0 and torch.allclose(counts, probs, atol=0.015)
    with pytest.raises(RuntimeError, match="NaN"):
        draw(torch.tensor([0.5, float("nan")]), gen)


def test_batched_warps_draw_from_hfs_warped_distribution():
    """Temperature, top-k and top-p applied to many rows at once (and the exact per-row path a row takes when its
    top-k or nucleus reaches beyond the candidates) draw from the distribution HF's warpers define."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from elastic_hf.engine.batched_sampling import CANDIDATES, Warp, sample_warped

    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(1, CANDIDATES + 150, generator=gen) * 3
    for warp in [Warp(0.7, 0, 0.9), Warp(1.0, 20, 1.0), Warp(1.3, 50, 0.8), Warp(0.5, 0, 1.0),
                 Warp(1.0, CANDIDATES + 40, 1.0), Warp(1.0, 0, 0.9999)]:
        hf = LogitsProcessorList([TemperatureLogitsWarper(warp.temperature)] +
                                 ([TopKLogitsWarper(warp.top_k)] if warp.top_k else []) +
                                 ([TopPLogitsWarper(warp.top_p)] if warp.top_p < 1 else []))(None, scores.clone())
        want = torch.softmax(hf[0], 0)
        draws = sample_warped(scores.repeat(3000, 1), [warp] * 3000, [gen] * 3000)
        got = torch.bincount(torch.tensor(draws), minlength=scores.shape[1]) / 3000
        assert got[want == 0].sum() == 0, warp              # nothing outside HF's kept set
        # total variation distance, against what 3,000 draws spread over the kept tokens give by chance
        noise = 0.4 * (float((want > 1e-4).sum()) / 3000) ** 0.5
        assert (got - want).abs().sum() / 2 < 0.03 + noise, warp
