"""One pipeline-parallel step on one worker (ReMP §3.2, KunServe §4.3): the step's micro-batches flow through the
stages point-to-point on global ranks, so stage s computes micro-batch k+1 while stage s+1 computes k.

Every transfer starts with a status header (int64 [status, num_tokens]): a stage that fails sends FAILED headers for
the micro-batches it still owed, and a stage that receives one skips its forward and passes the failure on. No stage
ever waits for activations that will not come (which would cost the collective timeout), and every worker still
drains what its upstream sends, so the step fails cleanly everywhere and the next one starts in lockstep."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

OK, FAILED = 0, 1
# A stage idle longer than this between two steps had no work (an idle server), which is not a pipeline bubble; a
# shorter gap (the control plane between a step's output and the next batch) is.
IDLE_GAP_S = 0.5


class StageFailed(RuntimeError):
    """An earlier stage failed this micro-batch (its own error is reported by its worker)."""


@dataclass(slots=True)
class PipelineStats:
    busy_s: float = 0.0          # time in this stage's forwards
    wall_s: float = 0.0          # the whole step on this worker, waits included
    sent_bytes: int = 0
    gap_s: float = 0.0           # idle before the step since this stage's previous one (< IDLE_GAP_S, else 0)
    recv_s: float = 0.0          # waiting for the previous stage's activations (pipeline fill, a slower upstream)
    flush_s: float = 0.0         # waiting for this stage's sends to complete at the end of the step

    @property
    def span_s(self) -> float:
        """The stage's time this step accounts for: the step and the idle gap before it."""
        return self.wall_s + self.gap_s

    @property
    def bubble_ratio(self) -> float:
        return 1.0 - self.busy_s / self.span_s if self.span_s > 0 else 0.0


@dataclass(slots=True)
class StageLinks:
    """Peers of this worker in its pipeline: the same TP rank of the previous and next stage (global ranks)."""
    prev: int | None
    next: int | None
    hidden_size: int
    dtype: torch.dtype
    device: torch.device
    pending: list = field(default_factory=list)   # sends not yet completed (their buffers must stay alive)
    last_end: float | None = None                 # perf_counter() at the end of this stage's previous step

    def send(self, status: int, hidden: torch.Tensor | None, num_tokens: int) -> int:
        import torch.distributed as dist

        header = torch.tensor([status, num_tokens], dtype=torch.long)
        self.pending.append((dist.isend(header, self.next), header))
        if status != OK:
            return 0
        payload = hidden.contiguous()                       # [T, hidden]
        self.pending.append((dist.isend(payload, self.next), payload))
        return payload.numel() * payload.element_size()

    def recv(self) -> tuple[int, torch.Tensor | None]:
        import torch.distributed as dist

        header = torch.empty(2, dtype=torch.long)
        dist.recv(header, self.prev)
        status, num_tokens = int(header[0]), int(header[1])
        if status != OK:
            return status, None
        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)   # [T, hidden]
        dist.recv(hidden, self.prev)
        return OK, hidden

    def flush(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def run_pipeline_step(runner, links: StageLinks, micro_batches: list[list]) -> tuple[torch.Tensor | None,
                                                                                       PipelineStats]:
    """This worker's part of one step. Returns the logits of every micro-batch concatenated in order (last stage;
    [num_sampling_seqs, vocab]) or None (other stages), and the stage's timings. Raises the first error of this
    stage, or StageFailed when an earlier stage failed, after passing the failure on and draining its input."""
    stats = PipelineStats()
    started = time.perf_counter()
    if links.last_end is not None and started - links.last_end < IDLE_GAP_S:
        stats.gap_s = started - links.last_end
    logits: list[torch.Tensor] = []
    error: BaseException | None = None
    try:
        for inputs in micro_batches:
            num_tokens = sum(len(seq.token_ids) for seq in inputs)
            hidden_in = None
            if links.prev is not None:
                t0 = time.perf_counter()
                status, hidden_in = links.recv()
                stats.recv_s += time.perf_counter() - t0
                if status != OK and error is None:
                    error = StageFailed("an earlier pipeline stage failed this step")
            if error is None:
                try:
                    t0 = time.perf_counter()
                    out = runner.execute(inputs, hidden_in)  # [T, hidden] or [num_sampling_seqs, vocab]
                    stats.busy_s += time.perf_counter() - t0
                except BaseException as exc:  # noqa: BLE001 - passed on downstream, then re-raised
                    error = exc
            if links.next is not None:
                stats.sent_bytes += links.send(FAILED if error is not None else OK,
                                               out if error is None else None, num_tokens)
            elif error is None:
                logits.append(out)
    finally:
        if links.pending:
            t0 = time.perf_counter()
            links.flush()
            stats.flush_s = time.perf_counter() - t0
        links.last_end = time.perf_counter()
        stats.wall_s = links.last_end - started
    if error is not None:
        raise error
    return (torch.cat(logits) if logits else None), stats
