"""logprobs through the real `openai` client on the default model, against HF's log-softmax of the same tokens:
chat `logprobs`/`top_logprobs`, completions `logprobs` with `echo` (prompt log-probabilities, as lm-eval's
loglikelihood tasks ask), streaming chunks adding up to the non-streaming answer."""
from __future__ import annotations

import openai
import pytest
import torch

from greedy_reference import hf_greedy

ATOL = 2e-3


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@torch.inference_mode()
def reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row i is HF's log-softmax predicting token i + 1."""
    return torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)


def chat_prompt_ids(server, content: str) -> list[int]:
    ids = server.model.tokenizer.apply_chat_template([{"role": "user", "content": content}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


def test_chat_logprobs_match_hf(default_server, default_reference):
    server = default_server
    question = "What is the capital of France? Answer in one word."
    resp = client_for(server).chat.completions.create(
        model=server.model_id, messages=[{"role": "user", "content": question}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=3)
    prompt = chat_prompt_ids(server, question)
    tokens = hf_greedy(default_reference, prompt, 6)
    reference = reference_logprobs(default_reference, prompt + tokens)[len(prompt) - 1:]
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens == len(tokens)
    tokenizer = server.model.tokenizer
    for entry, token, row in zip(content, tokens, reference):
        assert entry.token == tokenizer.decode([token])
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL)
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(row.topk(3).values.tolist(), abs=ATOL)
        assert entry.top_logprobs[0].token == entry.token   # greedy: the chosen token is the most likely


def test_completion_echo_logprobs_give_the_prompt_loglikelihood(default_server, default_reference):
    """lm-eval's local-completions loglikelihood request: echo + logprobs + max_tokens 1, then the sum of the
    continuation's prompt log-probabilities."""
    server = default_server
    context, continuation = "The capital of France is", " Paris"
    resp = client_for(server).completions.create(model=server.model_id, prompt=context + continuation,
                                                 max_tokens=1, temperature=0, logprobs=2, echo=True)
    choice = resp.choices[0]
    lp = choice.logprobs
    prompt = server.model.tokenizer.encode(context + continuation)
    assert choice.text.startswith(context + continuation)
    assert len(lp.tokens) == len(prompt) + 1 == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    reference = reference_logprobs(default_reference, prompt)
    for i in range(1, len(prompt)):
        assert lp.token_logprobs[i] == pytest.approx(float(reference[i - 1, prompt[i]]), abs=ATOL)
        assert lp.tokens[i] in lp.top_logprobs[i]             # the token itself is always listed
        assert len(lp.top_logprobs[i]) in (2, 3)               # top 2, plus the token when it is not among them
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[:len(prompt)]) == context + continuation
    # " Paris" is one token of this tokenizer, and a likely one after the context
    assert lp.tokens[len(prompt) - 1] == " Paris" and lp.token_logprobs[len(prompt) - 1] > -3.0


def test_streamed_logprobs_equal_the_whole_answer(default_server):
    server = default_server
    client = client_for(server)
    kwargs = dict(model=server.model_id, messages=[{"role": "user", "content": "Name three colours."}],
                  max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [entry for chunk in client.chat.completions.create(**kwargs, stream=True)
                for choice in chunk.choices if choice.logprobs for entry in choice.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in whole]
    completion = client.completions.create(model=server.model_id, prompt="Once upon a time", max_tokens=10,
                                           temperature=0, logprobs=1)
    pieces = list(client.completions.create(model=server.model_id, prompt="Once upon a time", max_tokens=10,
                                            temperature=0, logprobs=1, stream=True))
    tokens = [t for c in pieces for choice in c.choices if choice.logprobs for t in choice.logprobs.tokens]
    offsets = [o for c in pieces for choice in c.choices if choice.logprobs for o in choice.logprobs.text_offset]
    assert tokens == completion.choices[0].logprobs.tokens
    assert offsets == completion.choices[0].logprobs.text_offset
