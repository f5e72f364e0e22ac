"""Token selection. Rows under a structured-output constraint first get their grammar's token mask (one bitmask for
the step, engine/grammar.py); greedy rows without processors then take one batched argmax; rows with processors
(penalties, biases, bad words, min_tokens: transformers' and engine/logits_processors.py) run them alone; sampled
rows then get temperature / top-k / top-p together (engine/batched_sampling.py) and draw from their own seeded
generator, so a seed reproduces an output whatever else shares the batch."""
from __future__ import annotations

import random
import secrets
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                          NoBadWordsLogitsProcessor, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper)

from elastic_hf.engine.batched_sampling import Warp, draw, sample_warped
from elastic_hf.engine.logits_processors import (AllowedTokensProcessor, LogitBiasProcessor, OpenAIPenaltiesProcessor,
                                                 TopKTopPProcessor)
from elastic_hf.engine.outputs import TokenLogprob
from elastic_hf.engine.sequence import Sequence
from elastic_hf.native.argmax import argmax_rows
from elastic_hf.native.token_bitmask import apply_token_bitmask

# A step's grammar masks: the sampling rows under a constraint, and their int32 bitmask [len(rows), ceil(V / 32)]
GrammarMasks = tuple[list[int], torch.Tensor]


@dataclass(slots=True)
class SeqSamplerState:
    processors: LogitsProcessorList
    generator: torch.Generator | None  # None for greedy
    uses_history: bool                 # a penalty, min_tokens or bad_words read the token history
    warp: Warp | None = None           # a sampled row's temperature / top-k / top-p, applied batched


def request_seeds(server_seed: int) -> Iterator[int]:
    """The seeds a server started with --seed gives to requests that bring none, in the order it accepts them:
    the same request sequence reproduces its samples after a restart."""
    rng = random.Random(server_seed)
    while True:
        yield rng.getrandbits(63)


def make_sampler_state(seq: Sequence, fallback_seed: int | None = None,
                       eos_token_ids: list[int] = ()) -> SeqSamplerState:
    """fallback_seed: the seed when the request gives none (see request_seeds); None: a random one. eos_token_ids:
    the tokens min_tokens holds back (with the request's stop tokens)."""
    p = seq.params
    processors = LogitsProcessorList()
    # restrictions and biases first, then penalties, then (sampling only) the warpers: vLLM's order
    if p.allowed_token_ids is not None:
        processors.append(AllowedTokensProcessor(p.allowed_token_ids))
    if p.bad_words_token_ids:
        processors.append(NoBadWordsLogitsProcessor(p.bad_words_token_ids))
    if p.min_tokens > 0:
        held_back = sorted(set(eos_token_ids) | set(p.stop_token_ids))
        if held_back:
            processors.append(MinNewTokensLengthLogitsProcessor(seq.num_prompt_tokens, p.min_tokens, held_back))
    if p.logit_bias:
        processors.append(LogitBiasProcessor(p.logit_bias))
    if p.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        processors.append(OpenAIPenaltiesProcessor(p.presence_penalty, p.frequency_penalty, seq.num_prompt_tokens))
    uses_history = bool(p.bad_words_token_ids or p.min_tokens or p.repetition_penalty != 1.0
                        or p.presence_penalty or p.frequency_penalty)
    generator, warp = None, None
    if not p.is_greedy:
        if p.min_p > 0:   # min_p follows the other warpers (HF's order): the whole chain runs on this row alone
            if p.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(p.temperature))
            if p.top_k > 0 or p.top_p < 1.0:
                processors.append(TopKTopPProcessor(p.top_k, p.top_p))
            processors.append(MinPLogitsWarper(p.min_p))
        else:
            warp = Warp(p.temperature, p.top_k, p.top_p)
        base_seed = p.seed if p.seed is not None else fallback_seed
        if base_seed is None:
            base_seed = secrets.randbits(63)
        # n > 1 siblings draw from distinct but reproducible streams.
        generator = torch.Generator().manual_seed((base_seed + 1_000_003 * seq.index) % (2**63))
    return SeqSamplerState(processors, generator, uses_history, warp)


def sample(logits: torch.Tensor, seqs: list,
           grammar_masks: GrammarMasks | None = None) -> tuple[list[int | None], dict[int, Exception]]:
    """logits: [num_seqs, vocab] fp32, one row per sequence in `seqs` (Sequences, or RemoteSampling.row()s: what is
    read is `sampler_state` and, for a penalty, `token_ids`); masked in place by `grammar_masks`. Returns one token
    id per sequence, and the rows whose sampling raised (NaN logits, a failing logits processor) with their
    exception: their token is None and only their request fails; the other rows of the batch are unaffected."""
    if grammar_masks is not None:
        apply_token_bitmask(logits, *grammar_masks)
    # torch's argmax semantics (the first maximum; NaN counts as the maximum) on the native kernel: 0.15 ms for a
    # batch-32 step over 49k logits, against 0.45 ms for max(dim).indices and 0.80 for torch's CPU argmax
    tokens: list[int | None] = argmax_rows(logits)
    if logits.device.type != "cpu" and any(
            seq.sampler_state.processors or seq.sampler_state.generator is not None for seq in seqs):
        # Processors, warpers and draws run on the host, with each request's CPU generator (so a seed samples the
        # same tokens on either device): one copy of the step's logits, only when a row needs more than argmax.
        logits = logits.cpu()                                                             # [num_seqs, vocab]
    failures: dict[int, Exception] = {}
    warped: list[int] = []               # sampled rows whose warpers run batched
    processed: dict[int, torch.Tensor] = {}   # row -> its logits after its own processors
    for row, seq in enumerate(seqs):
        state: SeqSamplerState = seq.sampler_state
        if not state.processors and state.generator is None:
            continue
        try:
            scores = logits[row:row + 1]                                                  # [1, vocab]
            if state.processors:
                history = torch.tensor([seq.token_ids], dtype=torch.long) if state.uses_history else None
                scores = processed[row] = state.processors(history, scores.clone())
            if state.generator is None:
                tokens[row] = int(torch.argmax(scores, dim=-1))
            elif state.warp is None:   # its warpers ran among its processors
                tokens[row] = draw(torch.softmax(scores, dim=-1)[0], state.generator)
            else:
                warped.append(row)
        except Exception as exc:  # noqa: BLE001 - one request's sampling must not fail the batch
            tokens[row] = None
            failures[row] = exc
    if warped:
        scores = torch.cat([processed[r] if r in processed else logits[r:r + 1] for r in warped])   # [n, vocab]
        states = [seqs[r].sampler_state for r in warped]
        for row, result in zip(warped, sample_warped(scores, [s.warp for s in states],
                                                     [s.generator for s in states])):
            if isinstance(result, Exception):
                tokens[row] = None
                failures[row] = result
            else:
                tokens[row] = result
    return tokens, failures


def token_logprobs(logits: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprob]:
    """logits: [rows, vocab] raw model output; token_ids: the token of each row whose log-probability is wanted;
    num_top: how many of the most likely alternatives each row reports. Log-probabilities are of the raw
    distribution (vLLM's default `raw_logprobs` mode), so they do not depend on the request's sampling options."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)                                    # [rows, vocab]
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device).unsqueeze(1)   # [rows, 1]
    chosen = logprobs.gather(1, ids)                                                        # [rows, 1]
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    k = max(num_top, default=0)
    if k:
        top_values, top_ids = logprobs.topk(k, dim=-1)                                      # [rows, k]
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
    result = []
    for row, (token_id, logprob) in enumerate(zip(token_ids, chosen[:, 0].tolist())):
        top = list(zip(top_ids[row][:num_top[row]], top_values[row][:num_top[row]])) if num_top[row] else []
        result.append(TokenLogprob(token_id, logprob, ranks[row], top))
    return result


# ---------------------------------------------------------------- sampling where the logits are
# A multi-worker deployment samples in the worker that holds the logits and returns token ids: [num_seqs, vocab]
# fp32 logits through a pipe every step cost 6.3 MB at 32 sequences of a 49k vocabulary. What crosses instead is
# each row's sampling state, and the generator's state comes back, so a seed gives the same tokens either way.

@dataclass(slots=True)
class _Row:
    sampler_state: SeqSamplerState
    token_ids: list[int] | None


@dataclass(slots=True)
class RemoteSampling:
    """One sampling row as it travels to the worker: its logits processors, its generator's state as bytes (a
    torch tensor would take a pipe's slow shared-memory path) and the token history when a penalty reads it."""
    processors: LogitsProcessorList
    generator_state: bytes | None
    history: list[int] | None
    token_bitmask: bytes | None = None   # the row's grammar mask (int32 words), when under a constraint
    warp: Warp | None = None

    @classmethod
    def of(cls, seq: Sequence, token_bitmask: bytes | None = None) -> "RemoteSampling":
        state: SeqSamplerState = seq.sampler_state
        generator = state.generator.get_state().numpy().tobytes() if state.generator is not None else None
        return cls(state.processors, generator, list(seq.token_ids) if state.uses_history else None, token_bitmask,
                   state.warp)

    def row(self) -> _Row:
        generator = None
        if self.generator_state is not None:
            generator = torch.Generator()
            generator.set_state(torch.frombuffer(bytearray(self.generator_state), dtype=torch.uint8))
        return _Row(SeqSamplerState(self.processors, generator, self.history is not None, self.warp), self.history)


@dataclass(slots=True)
class SampledStep:
    """What a worker returns for a step it sampled: a token per row (None where sampling failed), the failures as
    'Type: message', and the advanced generator state of every row that has a generator."""
    tokens: list[int | None]
    failures: dict[int, str]
    generator_states: dict[int, bytes]


def sample_remote(logits: torch.Tensor, rows: list[RemoteSampling]) -> SampledStep:
    """`sample` on the worker side. logits: [len(rows), vocab]."""
    local = [r.row() for r in rows]
    masked = [i for i, r in enumerate(rows) if r.token_bitmask is not None]
    masks = None
    if masked:
        words = torch.stack([torch.frombuffer(bytearray(rows[i].token_bitmask), dtype=torch.int32) for i in masked])
        masks = (masked, words)                                                 # [len(masked), W]
    tokens, failures = sample(logits, local, masks)
    states = {i: row.sampler_state.generator.get_state().numpy().tobytes()
              for i, row in enumerate(local) if row.sampler_state.generator is not None}
    return SampledStep(tokens, {i: f"{type(e).__name__}: {e}" for i, e in failures.items()}, states)


def adopt_sampled(step: SampledStep, seqs: list[Sequence]) -> tuple[list[int | None], dict[int, str]]:
    """The engine side: each sequence's generator takes the state its worker advanced it to."""
    for i, state in step.generator_states.items():
        seqs[i].sampler_state.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return step.tokens, step.failures
