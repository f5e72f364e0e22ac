"""The typed messages of one engine step (torch-free), as in vLLM v1's loop: the scheduler's `SchedulerOutput`
(which sequences run, how many tokens each, which of them sample), the packed `SeqStepInput`s the data plane runs,
and the `ModelRunnerOutput` that comes back (sampled ids, failures, log-probabilities, stage timings); and the
`Runner` protocol the engine drives. A runner is the model of one worker (model/runner.py) or, in a deployment, a
stand-in that sends the step to every worker of an instance."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic_hf.engine.sequence import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    # Offset of the chunk's first token: the sequence's computed tokens, plus those of its earlier chunks still in
    # flight (a pipeline may carry a prompt's next chunk in the batch behind the one computing its previous chunk).
    start: int

    @property
    def completes_prompt(self) -> bool:
        """True when after this step every token of the sequence is in the cache, so it samples."""
        return self.start + self.num_new_tokens == len(self.seq.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step as the scheduler decided it: running sequences first (oldest first), then the admitted ones, each
    with its chunk; `sampling_seqs` are the step's sampling rows, in that order (taken when the step is scheduled:
    whether a chunk completes its sequence is a property of the state before the step). Iterating it yields the
    ScheduledSeq records."""
    scheduled: list[ScheduledSeq]
    # Prefix-cache lookups of the sequences admitted this step: prompt tokens looked up, and of them found computed.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    sampling_seqs: list[Sequence] = field(init=False)

    def __post_init__(self):
        self.sampling_seqs = [s.seq for s in self.scheduled if s.completes_prompt]

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __iter__(self):
        return iter(self.scheduled)

    def __len__(self) -> int:
        return len(self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


@dataclass(slots=True)
class ModelRunnerOutput:
    """What a step gave back, one entry per sampling row of its SchedulerOutput: the sampled token (None where
    sampling failed: `failures` says why, and that request fails alone), its log-probability record when the
    sequence asked for them, and the pipeline stages' timings of a pipelined step."""
    sampled_token_ids: list[int | None]
    failures: dict[int, str] = field(default_factory=dict)
    logprobs: list[Any] | None = None        # TokenLogprob or None per row; None: no row asked
    stage_stats: list[dict] | None = None


@dataclass(slots=True)
class SeqStepInput:
    token_ids: list[int]   # the new tokens of this step (a prefill chunk, or the one last token when decoding)
    num_computed: int      # tokens already in the KV cache
    block_ids: list[int]
    needs_logits: bool     # last chunk of a prefill, or a decode
    # Logits of every token of the chunk, not only the last (prompt log-probabilities): the runner then returns
    # len(token_ids) rows for this input, the last of which is the sampling row when needs_logits.
    all_logits: bool = False


class Runner(Protocol):
    def execute(self, inputs: list[SeqStepInput]):
        """Run one packed step; returns the logits [rows, vocab] (a torch tensor, fp32) in the inputs' order: one row
        per input with needs_logits, len(token_ids) rows per input with all_logits, none for the others."""
        ...

    # Optional: a runner whose logits live in another process says so with `samples_remotely = True` and offers
    #   execute_sampled(inputs, sampling: list[RemoteSampling]) -> SampledStep   (engine/sampler.py)
    # which samples the needs_logits rows where they were computed and returns token ids; the engine uses it for
    # every step in which no row asks for log-probabilities.
