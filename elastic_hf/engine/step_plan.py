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


class Runner(Protocol):
    def execute(self, inputs: list[SeqStepInput]):
        """Run one packed step; returns the logits [num_sampling_seqs, vocab] (a torch tensor, fp32) of the inputs
        with needs_logits, in their order."""
        ...
