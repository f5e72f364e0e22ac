"""The runner of a single-worker CUDA model with graphs on: it wraps the eager ModelRunner and replays decode-only
steps from captured CUDA graphs (model/cuda_graphs.py); every other step (a prefill chunk, prompt log-probabilities,
a windowed sequence, a batch larger than the largest capture, a pipeline stage) runs on the wrapped runner. The
eager runner knows nothing of graphs, and a failed capture turns the wrapper into a pass-through."""
from __future__ import annotations

import logging

import torch
from torch import nn

from elastic_hf.model.cuda_graphs import DecodeGraphs, GraphCaptureError
from elastic_hf.model.runner import ModelRunner, callers_order
from elastic_hf.model.stage import StageSpec

log = logging.getLogger(__name__)


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, graphs: DecodeGraphs):
        self.runner = runner
        self.decode_graphs: DecodeGraphs | None = graphs   # None after a failed capture: eager from then on

    @classmethod
    def capture_decodes(cls, runner: ModelRunner, layers: nn.ModuleList, max_batch: int) -> "CudaGraphRunner":
        """Replay decode-only steps of up to `max_batch` sequences (graphs captured lazily, per padded size)."""
        return cls(runner, DecodeGraphs(runner.model, layers, max_batch, runner.device, runner.attention))

    # The wrapped runner's state, as the worker and the instance reach it.
    @property
    def pool(self):
        return self.runner.pool

    @pool.setter
    def pool(self, pool) -> None:
        self.runner.pool = pool

    @property
    def stage(self) -> StageSpec | None:
        return self.runner.stage

    def set_stage(self, spec: StageSpec, layers: nn.ModuleList) -> None:
        self.runner.set_stage(spec, layers)

    @torch.inference_mode()
    def execute(self, inputs: list, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """As ModelRunner.execute; a step of sampling decodes only, on the whole model, replays one graph."""
        runner = self.runner
        step = runner.pack(inputs)
        graphs = self.decode_graphs
        if graphs is not None and runner.stage is None and step.is_sampling_decode and graphs.fits(len(inputs)):
            try:
                logits = graphs.run(runner.pool, step.input_ids, step.positions, step.batch)  # [num_seqs, vocab]
            except GraphCaptureError as exc:
                log.warning("CUDA graph capture failed (%s): decode steps run eagerly from now on", exc)
                self.decode_graphs = None
            else:
                return callers_order(logits, step.logit_owner)
        return runner.forward(step, hidden_in)
