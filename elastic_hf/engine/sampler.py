"""Token selection through transformers' logits processors. Greedy rows (no penalty) take one batched argmax;
the others run their own processor list and their own seeded generator, so a seed reproduces an output
whatever else shares the batch."""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from elastic_hf.engine.sequence import Sequence


@dataclass(slots=True)
class SeqSamplerState:
    processors: LogitsProcessorList
    generator: torch.Generator | None  # None for greedy
    uses_history: bool                 # repetition penalty needs the token history


def make_sampler_state(seq: Sequence) -> SeqSamplerState:
    p = seq.params
    processors = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    generator = None
    if not p.is_greedy:
        if p.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            processors.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            processors.append(TopPLogitsWarper(p.top_p))
        base_seed = p.seed if p.seed is not None else secrets.randbits(63)
        # n > 1 siblings draw from distinct but reproducible streams.
        generator = torch.Generator().manual_seed((base_seed + 1_000_003 * seq.index) % (2**63))
    return SeqSamplerState(processors, generator, p.repetition_penalty != 1.0)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits: [num_seqs, vocab] fp32, one row per sequence in `seqs`. Returns one token id per sequence."""
    tokens = torch.argmax(logits, dim=-1).tolist()
    for row, seq in enumerate(seqs):
        state: SeqSamplerState = seq.sampler_state
        if not state.processors and state.generator is None:
            continue
        scores = logits[row:row + 1]  # [1, vocab]
        if state.processors:
            history = torch.tensor([seq.token_ids], dtype=torch.long) if state.uses_history else None
            scores = state.processors(history, scores.clone())
        if state.generator is None:
            tokens[row] = int(torch.argmax(scores, dim=-1))
        else:
            probs = torch.softmax(scores, dim=-1)
            tokens[row] = int(torch.multinomial(probs, 1, generator=state.generator))
    return tokens
