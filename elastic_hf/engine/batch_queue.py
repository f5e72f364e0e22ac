"""Cross-step pipelining (KunServe §4.3's pipeline kept full; vLLM's batch queue for pipeline parallelism): a
pipelined instance keeps up to `depth` batches in flight, so stage s computes batch t+1 while stage s+1 finishes
batch t, instead of draining the pipe at every step (bubble (pp-1)/(2pp-1) with pp micro-batches per step, 1/2 with
one).

One engine step = collect the oldest batch's output (update the sequences, stop conditions, outputs) and send the
next batch, so the control plane's work for batch t overlaps the workers' computation of t+1. A decode belongs to at
most one batch in flight (Scheduler.in_flight): its next token needs the previous one. A prompt's next chunk may
ride in the batch behind the one computing its previous chunk when that chunk does not sample
(Scheduler.continues_in_flight): a long prompt then advances in every batch, not every other one. Each batch takes
about 1/depth of the runnable sequences and of the token budget, so the batches stay the same size as load comes
and goes.

Control-plane actions that change the instances (a reshape, a drop, recovery) first `drain()`: the batches in flight
finish and their outputs wait for the next step(); after a worker died, `discard()` forgets them (their sequences'
scheduler state is as before the batch, so the next step computes those tokens again)."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from math import ceil

from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.step_plan import ModelRunnerOutput, SchedulerOutput


class BatchQueue:
    def __init__(self, engine):
        self.engine = engine
        # (the batch, a call that waits for its ModelRunnerOutput), oldest first
        self.in_flight: deque[tuple[SchedulerOutput, Callable[[], ModelRunnerOutput]]] = deque()
        self.stashed: list[RequestOutput] = []   # outputs of batches drained between steps, for the next step()

    def depth(self) -> int:
        """Batches the engine may keep in flight: what its runner allows (a pipelined instance whose workers run
        apart from the control plane), 1 while step-boundary hooks (morph controllers) need a quiet instance."""
        engine = self.engine
        allowed = getattr(engine.runner, "max_batches_in_flight", None)
        if allowed is None or engine.step_boundary_hooks:
            return 1
        return max(1, allowed())

    def active(self) -> bool:
        """Step through the queue: pipelined, or batches still in flight from before a change of depth."""
        return bool(self.in_flight or self.stashed) or self.depth() > 1

    def step(self) -> list[RequestOutput]:
        outputs, self.stashed = self.stashed, []
        self._fill()
        if not self.in_flight:
            self.engine._update_gauges()
            return outputs
        outputs += self._finish_oldest()
        self._fill()   # the next batch goes out before the caller handles these outputs
        return outputs

    def _fill(self) -> None:
        engine = self.engine
        scheduler = engine.scheduler
        depth = self.depth()
        while len(self.in_flight) < depth:
            # Each batch about 1/depth of everything active, so the batches in flight stay alike in size.
            active = scheduler.num_runnable() + len(scheduler.in_flight)
            scheduler_output = scheduler.schedule(max_seqs=max(1, ceil(active / depth)),
                                                  budget=scheduler.max_num_batched_tokens // depth)
            engine._count_prefix_cache(scheduler_output)
            if not scheduler_output:
                return
            scheduler.send(scheduler_output)
            try:
                finish = engine._submit(scheduler_output)
            except BaseException:
                scheduler.land(scheduler_output)
                raise
            self.in_flight.append((scheduler_output, finish))

    def _finish_oldest(self) -> list[RequestOutput]:
        scheduler_output, finish = self.in_flight.popleft()
        try:
            runner_output = finish()
        finally:
            self.engine.scheduler.land(scheduler_output)
        return self.engine._complete(scheduler_output, runner_output)

    def drain(self) -> None:
        """Finish every batch in flight; their outputs come with the next step()."""
        while self.in_flight:
            self.stashed += self._finish_oldest()

    def take_stashed(self) -> list[RequestOutput]:
        """The drained outputs, handed to whoever outlives this engine (a reshape retires it)."""
        outputs, self.stashed = self.stashed, []
        return outputs

    def discard(self) -> None:
        """Forget the batches in flight (their workers failed): their sequences are scheduled again."""
        for scheduler_output, _ in self.in_flight:
            self.engine.scheduler.land(scheduler_output)
        self.in_flight.clear()
