"""Log-probabilities of sampled and prompt tokens against the untouched HF model's log-softmax, through chunked
prefill and preemption; and a request whose sampling raises fails alone while the rest of its batch finishes."""
import pytest
import torch

from elastic_hf import ElasticModel, SamplingParams
from greedy_reference import hf_greedy, mixed_prompts

ATOL = 2e-3   # fp32 paged attention vs HF's sdpa differ by ~1e-5 in logits; log-softmax over 49k keeps that scale


@torch.inference_mode()
def hf_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of HF's logits at every position (row i predicts token i + 1)."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def check_against(reference: torch.Tensor, records, targets: list[int], top: int) -> None:
    """records[i] is the TokenLogprob of targets[i], predicted by reference row i."""
    assert len(records) == len(targets)
    for row, (record, token) in enumerate(zip(records, targets)):
        expected = reference[row]
        assert record.token_id == token
        assert record.logprob == pytest.approx(float(expected[token]), abs=ATOL)
        expected_rank = int((expected > expected[token]).sum()) + 1
        near_ties = int(((expected - expected[token]).abs() <= ATOL).sum()) - 1   # may order either way
        assert abs(record.rank - expected_rank) <= near_ties
        assert len(record.top) == top
        values, ids = expected.topk(top)
        assert [v for _, v in record.top] == pytest.approx(values.tolist(), abs=ATOL)
        # ids agree except where two alternatives are within the tolerance of each other
        for (got_id, _), want_id, want_value in zip(record.top, ids.tolist(), values.tolist()):
            assert got_id == want_id or float(expected[got_id]) == pytest.approx(want_value, abs=ATOL)


def test_default_model_logprobs_match_hf_log_softmax(default_model, default_reference):
    prompt = default_model.tokenizer.encode("The capital of France is Paris. The capital of Italy is")
    out = default_model.generate(prompt, max_tokens=8, logprobs=5, prompt_logprobs=3)
    completion = out.outputs[0]
    assert completion.token_ids == hf_greedy(default_reference, prompt, 8)
    reference = hf_logprobs(default_reference, prompt + completion.token_ids)
    # output token i is predicted by position len(prompt) - 1 + i
    check_against(reference[len(prompt) - 1:], completion.logprobs, completion.token_ids, 5)
    assert all(r.rank == 1 for r in completion.logprobs)   # greedy picks the most likely token
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    check_against(reference, out.prompt_logprobs[1:], prompt[1:], 3)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    from elastic_hf.model.loader import load_hf_model

    path = tiny_checkpoint("llama")
    reference, _ = load_hf_model(path)
    # 16-token steps: a 60-token prompt is prefilled in 4 chunks, each returning its own prompt logits
    model = ElasticModel.from_pretrained(path, kv_cache_memory=32 << 20, max_num_batched_tokens=16)
    return model, reference


def test_prompt_logprobs_across_prefill_chunks_and_siblings(tiny):
    model, reference = tiny
    prompts = mixed_prompts(model.tokenizer, 3, 40, 60, seed=11)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2, prompt_logprobs=4)
    outs = model.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        ref = hf_logprobs(reference, prompt + out.outputs[0].token_ids)
        check_against(ref, out.prompt_logprobs[1:], prompt[1:], 4)
        check_against(ref[len(prompt) - 1:], out.outputs[0].logprobs, out.outputs[0].token_ids, 2)
    # n = 2 sampled siblings: each sequence's logprobs are of its own tokens
    sampled = model.generate(prompts[0], max_tokens=6, temperature=1.0, seed=3, n=2, logprobs=0)
    for completion in sampled.outputs:
        ref = hf_logprobs(reference, prompts[0] + completion.token_ids)
        check_against(ref[len(prompts[0]) - 1:], completion.logprobs, completion.token_ids, 0)


def test_no_logprobs_unless_asked(tiny):
    model, _ = tiny
    out = model.generate("Hello there", max_tokens=4)
    assert out.prompt_logprobs is None and out.outputs[0].logprobs is None


def test_stream_delta_logprobs_add_up(tiny):
    model, _ = tiny
    deltas, last = [], None
    for out in model.stream("Once upon a time", max_tokens=12, logprobs=1):
        deltas.extend(out.outputs[0].delta_logprobs)
        last = out
    assert [r.token_id for r in deltas] == last.outputs[0].token_ids
    assert [r.logprob for r in deltas] == [r.logprob for r in last.outputs[0].logprobs]


@pytest.mark.parametrize("kwargs, message", [
    ({"logprobs": 21}, r"logprobs must be an integer in \[0, 20\], got 21"),
    ({"prompt_logprobs": -1}, r"prompt_logprobs must be an integer in \[0, 20\], got -1"),
])
def test_bad_logprobs_fail_clearly(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_failing_sampling_fails_its_request_alone(tiny):
    """A logits processor that raises (as NaN logits make the sampler raise) ends that request with an error;
    the 8 others of the same batch get their exact greedy tokens and every block comes back."""
    model, reference = tiny
    engine = model.deployment.instances[0].engine   # the LLMEngine of the one instance
    prompts = mixed_prompts(model.tokenizer, 9, 5, 20, seed=2)
    params = SamplingParams(max_tokens=10, temperature=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)

    def explode(input_ids, scores):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0")

    engine.requests["r4"].seqs[0].sampler_state.processors.append(explode)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["r4"].outputs[0].finish_reason == "error"
    assert "probability tensor" in finished["r4"].error
    for i, prompt in enumerate(prompts):
        if i != 4:
            assert finished[f"r{i}"].error is None
            assert finished[f"r{i}"].outputs[0].token_ids == hf_greedy(reference, prompt, 10)
    assert engine.scheduler.kv.num_used == 0
