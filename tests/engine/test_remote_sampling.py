"""Sampling where the logits are (a multi-worker deployment's rank 0) gives the tokens of sampling in the engine:
the same rows, processors and seeded generator streams, across a pickled round trip like a worker's pipe, and a
row whose sampling raises fails alone."""
import pickle
from types import SimpleNamespace

import torch

from elastic_hf import SamplingParams
from elastic_hf.engine.sampler import RemoteSampling, adopt_sampled, make_sampler_state, sample, sample_remote

VOCAB = 300
ROW_PARAMS = [
    SamplingParams(temperature=0.0),                                    # greedy: one batched argmax
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=2),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),            # greedy, reads the history
    SamplingParams(temperature=0.7, repetition_penalty=1.3, seed=3),
]


def _seqs():
    seqs = [SimpleNamespace(params=p, index=0, token_ids=[5, 7, 5, 11]) for p in ROW_PARAMS]
    for seq in seqs:
        seq.sampler_state = make_sampler_state(seq)
    return seqs


def _through_pipe(obj):
    return pickle.loads(pickle.dumps(obj))


def test_remote_sampling_matches_local_over_steps():
    local, remote = _seqs(), _seqs()
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        logits = torch.randn(len(ROW_PARAMS), VOCAB, generator=gen) * 3              # [rows, vocab]
        logits[:, 5] += 4.0   # a token the penalty rows have seen: the penalty must matter
        want, want_failures = sample(logits, local)
        sampled = _through_pipe(sample_remote(logits, _through_pipe([RemoteSampling.of(s) for s in remote])))
        got, failures = adopt_sampled(sampled, remote)
        assert got == want and not failures and not want_failures, f"step {step}"
        for seq, token in zip(local + remote, want + got):
            seq.token_ids.append(token)
    # the seeded generators advanced alike: the next draws agree too
    for a, b in zip(local, remote):
        if a.sampler_state.generator is not None:
            assert torch.equal(a.sampler_state.generator.get_state(), b.sampler_state.generator.get_state())


def test_a_failing_row_fails_alone():
    seqs = _seqs()
    logits = torch.randn(len(ROW_PARAMS), VOCAB)
    logits[2] = float("nan")    # a sampled row: the sampler refuses NaN probabilities
    tokens, failures = adopt_sampled(sample_remote(logits, [RemoteSampling.of(s) for s in seqs]), seqs)
    assert list(failures) == [2] and "RuntimeError" in failures[2]
    assert tokens[2] is None and all(isinstance(t, int) for i, t in enumerate(tokens) if i != 2)
