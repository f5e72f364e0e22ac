"""An instance of a deployment as the control plane sees it: its workers, its layout (TP x PP) and the engine's
Runner that sends a step to those workers. A pipelined instance gets each step as micro-batches, one per stage, so
every stage has work once the pipe is full (parallel/pipeline.py runs them on the workers)."""
from __future__ import annotations

from dataclasses import dataclass

from elastic_hf.engine.llm_engine import LLMEngine
from elastic_hf.topology import InstanceShape


class InstanceRunner:
    """The engine's Runner for one instance: a step goes to every worker of the instance; rank 0's logits come
    back. A pipelined instance gets the step as micro-batches (parallel/pipeline.py): every worker receives all of
    them at once and they flow through the stages point-to-point; the last stage's rank 0 returns the logits."""

    def __init__(self, pool, workers: tuple[int, ...], shape: InstanceShape, on_pipeline_step=None):
        self.pool = pool
        self.workers = workers
        self.shape = shape
        self.on_pipeline_step = on_pipeline_step   # (stage stats of every worker) -> None, for the metrics

    def execute(self, inputs):
        if self.shape.pp == 1:
            return self.pool.call_many(self.workers, "execute", inputs)[0]  # [num_sampling_seqs, vocab]
        micro_batches = split_micro_batches(inputs, self.shape.pp)
        results = self.pool.call_many(self.workers, "execute_pipeline", micro_batches)
        if self.on_pipeline_step is not None:
            self.on_pipeline_step([stats for _, stats in results], self.workers)
        return results[(self.shape.pp - 1) * self.shape.tp][0]  # last stage, rank 0: [num_sampling_seqs, vocab]


def split_micro_batches(inputs: list, num_stages: int) -> list[list]:
    """Contiguous groups of the step's sequences with about equal token counts, one per stage (fewer when the step
    has fewer sequences): with as many micro-batches in flight as stages, every stage has work once the pipe is
    full. Contiguous, so the concatenated logits keep the inputs' order."""
    count = min(num_stages, len(inputs))
    if count <= 1:
        return [list(inputs)]
    total = sum(len(seq.token_ids) for seq in inputs)
    groups, current, done = [], [], 0
    for i, seq in enumerate(inputs):
        current.append(seq)
        done += len(seq.token_ids)
        left_groups = count - len(groups) - 1
        left_seqs = len(inputs) - i - 1
        if left_groups > 0 and (done >= total * (len(groups) + 1) / count or left_seqs == left_groups):
            groups.append(current)
            current = []
    groups.append(current)
    return [g for g in groups if g]


@dataclass(slots=True)
class Instance:
    workers: tuple[int, ...]
    engine: LLMEngine
    shape: InstanceShape = InstanceShape(1)

    @property
    def tp(self) -> int:
        """Workers of the instance (its TP degree when it is not pipelined)."""
        return len(self.workers)

    @property
    def key(self) -> tuple[tuple[int, ...], InstanceShape]:
        return self.workers, self.shape
