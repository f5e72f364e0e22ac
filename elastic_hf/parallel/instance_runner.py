"""An instance of a deployment as the control plane sees it: its workers, its layout (TP x PP) and the engine's
Runner that sends a step to those workers. A pipelined instance gets each step as micro-batches, one per stage, so
every stage has work once the pipe is full (parallel/pipeline.py runs them on the workers): by token counts, or by
cost with a cost model set (`lookahead`, KunServe §4.3), which may cut a sequence's chunk between micro-batches."""
from __future__ import annotations

from dataclasses import dataclass

from elastic_hf.engine.cost_fit import OnlineCostFit
from elastic_hf.engine.cost_model import Chunk, CostModel
from elastic_hf.engine.llm_engine import LLMEngine
from elastic_hf.engine.lookahead import WorkItem, cost_chosen_split
from elastic_hf.engine.step_plan import SeqStepInput
from elastic_hf.topology import InstanceShape


class InstanceRunner:
    """The engine's Runner for one instance: a step goes to every worker of the instance; rank 0's logits come
    back. A pipelined instance gets the step as micro-batches (parallel/pipeline.py): every worker receives all of
    them at once and they flow through the stages point-to-point; the last stage's rank 0 returns the logits."""

    def __init__(self, pool, workers: tuple[int, ...], shape: InstanceShape, on_pipeline_step=None,
                 pipeline_batches: int | None = None):
        self.pool = pool
        self.workers = workers
        self.shape = shape
        self.pipeline_batches = pipeline_batches   # EngineConfig.pipeline_batches: None, one per stage
        self.on_pipeline_step = on_pipeline_step   # (stage stats of every worker) -> None, for the metrics
        self.lookahead: CostModel | None = None    # set on pipelined instances (OverloadControl.apply_lookahead)
        # |predicted - measured| / measured busy seconds of the last stage on the last lookahead step (the
        # elastic_hf_cost_model_error gauge); None until a lookahead step ran
        self.last_cost_error: float | None = None
        # no cost model yet (a model without a profile): every pipelined step's stage times feed this fit
        self.cost_fit: OnlineCostFit | None = None
        # (stage stats of every worker) -> None: a KV exchange's progress rides on them (OverloadControl)
        self.on_stage_reports = None
        # the CPU-share cap of a KV exchange on these workers, sent with every step (None: unchanged; OverloadControl
        # sets it at each step boundary while an exchange is in flight)
        self.exchange_cpu_share: float | None = None

    def execute(self, inputs):
        return self._run(inputs, None)   # [num_sampling_seqs, vocab]

    @property
    def samples_remotely(self) -> bool:
        """Sample on the worker (execute_sampled) only when its logits would otherwise cross a pipe: in process,
        shipping each row's sampling state there and back buys nothing."""
        return self.pool.crosses_processes

    def execute_sampled(self, inputs, sampling):
        """The step, sampled on the worker that holds the logits (engine/sampler.py): a SampledStep comes back."""
        return self._run(inputs, sampling)

    def max_batches_in_flight(self) -> int:
        """Cross-step pipelining (engine/batch_queue.py): a pipelined instance whose workers run apart from the
        control plane keeps one batch in flight per stage (or EngineConfig.pipeline_batches); otherwise 1."""
        if self.shape.pp == 1 or not self.pool.overlaps_calls:
            return 1
        return self.pipeline_batches or self.shape.pp

    def submit_sampled(self, inputs, sampling):
        """Send a sampled step of a pipelined instance and return a call that waits for its SampledStep. With
        several batches in flight a decode-only batch is one micro-batch (the other batches keep the stages
        busy; on a CPU every further micro-batch pays the weight stream again); a batch with prefill chunks is
        still cut per stage, so a long prompt alone in the pipe does not leave the other stages idle."""
        micro_batches = self._micro_batches(inputs, whole=all(len(s.token_ids) == 1 for s in inputs))
        call = self.pool.submit_pipeline(self.workers, micro_batches, sampling, self.exchange_cpu_share)
        return lambda: self._pipeline_result(micro_batches, self.pool.wait_rpc(call))

    def _micro_batches(self, inputs, whole: bool = False) -> list[list]:
        if whole:
            return [list(inputs)]
        if self.lookahead is not None:
            return lookahead_micro_batches(inputs, self.shape, self.lookahead)
        return split_micro_batches(inputs, self.shape.pp)

    def _run(self, inputs, sampling):
        if self.shape.pp == 1:
            return self.pool.execute_model(self.workers, inputs, sampling)
        micro_batches = self._micro_batches(inputs)
        return self._pipeline_result(micro_batches, self.pool.execute_pipeline(self.workers, micro_batches, sampling,
                                                                               self.exchange_cpu_share))

    def _pipeline_result(self, micro_batches: list[list], results: list[tuple]):
        model = self.lookahead
        if self.on_pipeline_step is not None:
            self.on_pipeline_step([stats for _, stats in results], self.workers)
        if self.on_stage_reports is not None:
            self.on_stage_reports([stats for _, stats in results])
        logits, last_stats = results[(self.shape.pp - 1) * self.shape.tp]   # last stage, rank 0
        if self.cost_fit is not None:
            self._add_cost_samples(micro_batches, results)
        if model is not None and last_stats["busy_s"] > 0:
            fraction = last_stage_fraction(self.shape, model)
            predicted = sum(model.batch_cost(chunks, fraction) for chunks in micro_batch_chunks(micro_batches))
            self.last_cost_error = abs(predicted - last_stats["busy_s"]) / last_stats["busy_s"]
        return logits  # [num_sampling_seqs, vocab], or a SampledStep when `sampling` was given

    def _add_cost_samples(self, micro_batches: list[list], results: list[tuple]) -> None:
        """Each stage's busy seconds of this step (rank 0 of each stage), with what its micro-batches held."""
        fit, shape = self.cost_fit, self.shape
        chunks = micro_batch_chunks(micro_batches)
        for stage in range(shape.pp):
            stats = results[stage * shape.tp][1]
            fit.add(chunks, stage_fraction(shape, fit.num_layers, stage), stage == shape.pp - 1, stats["busy_s"])


def micro_batch_chunks(micro_batches: list[list[SeqStepInput]]) -> list[list[Chunk]]:
    """What the cost model sees of each micro-batch: every input's prefix, new tokens and whether it samples."""
    return [[Chunk(s.num_computed, len(s.token_ids), s.needs_logits) for s in mb] for mb in micro_batches]


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


def lookahead_micro_batches(inputs: list[SeqStepInput], shape: InstanceShape, model: CostModel) -> list[list]:
    """Micro-batches of equal predicted cost (engine/lookahead.py). A piece [start, end) of input s becomes an
    input of its own that starts `start` tokens later in the cache and samples only if it ends the chunk. The
    rows still come back in the inputs' order: the pieces of s are consecutive in the stream and micro-batches run
    in order on every stage, so a stage writes the KV of s's first piece before it attends from the next."""
    layer_fraction = last_stage_fraction(shape, model)
    items = [WorkItem(s.num_computed, len(s.token_ids), s.needs_logits) for s in inputs]
    return [[SeqStepInput(inputs[p.item].token_ids[p.start:p.end], inputs[p.item].num_computed + p.start,
                          inputs[p.item].block_ids, inputs[p.item].needs_logits and p.end == items[p.item].tokens,
                          inputs[p.item].all_logits) for p in micro_batch]
            for micro_batch in cost_chosen_split(items, model, shape.pp, layer_fraction=layer_fraction)]


def last_stage_fraction(shape: InstanceShape, model: CostModel) -> float:
    """The share of the decoder layers the last stage holds (it also pays the LM head rows)."""
    return stage_fraction(shape, model.num_layers, shape.pp - 1)


def stage_fraction(shape: InstanceShape, num_layers: int, stage: int) -> float:
    """The share of `num_layers` decoder layers that pipeline stage `stage` holds."""
    try:
        first, end = shape.stage_bounds(num_layers)[stage]
        return (end - first) / num_layers
    except ValueError:   # a layer split of another model than the profiled one: weigh the stages alike
        return 1.0 / shape.pp


@dataclass(slots=True)
class Instance:
    """One instance as the plan executors see it: its workers, its engine (requests, scheduler, KV manager) and
    the runner that sends its steps to the workers (the deployment sets the runner's lookahead; the engine only
    drives it)."""
    workers: tuple[int, ...]
    engine: LLMEngine
    shape: InstanceShape
    runner: InstanceRunner

    @property
    def tp(self) -> int:
        """Workers of the instance (its TP degree when it is not pipelined)."""
        return len(self.workers)

    @property
    def key(self) -> tuple[tuple[int, ...], InstanceShape]:
        return self.workers, self.shape
