"""What one engine step asks of the data plane, as data: the packed sequences of the step (torch-free), and the
`Runner` protocol the engine drives. A runner is the model of one worker (model/runner.py) or, in a deployment, a
stand-in that sends the step to every worker of an instance."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


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
