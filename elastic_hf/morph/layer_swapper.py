"""LayerSwapper: asynchronous in-place precision swaps of decoder layers inside the weights arena
(MorphServe §4.3).

A swap of layer i from precision A to B:
  1. commit B's range (a quant slot, or the fp region; for fp the KV cache first gives back free blocks),
  2. copy B's host image into it on the copier (copy thread / side stream) while forwards keep running on A,
  3. at the next step boundary whose poll() sees the copy done: `layers[i] = module_B` (the per-layer fence:
     a forward reads A or B, never a half-written B), then decommit A's range.
`poll()` must only run where no forward pass is running (LLMEngine.step_boundary_hooks)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from elastic_hf.memory.arena import PageArena
from elastic_hf.memory.budget import MemoryBudgetExceeded
from elastic_hf.model.weight_placement import ArenaRange
from elastic_hf.morph.copier import CopyHandle
from elastic_hf.morph.layer_store import LayerStore

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SwapRecord:
    layer: int
    src: str
    dst: str
    nbytes_copied: int
    copy_s: float        # the copy itself
    latency_s: float     # request -> switch (includes waiting for budget and for the step boundary)
    freed_bytes: int     # bytes of the old range given back


@dataclass(slots=True)
class _Job:
    layer: int
    src: str
    dst: str
    requested_at: float
    copy: CopyHandle | None = None
    waiting_for_room: bool = False


@dataclass(slots=True)
class SwapCounters:
    num_swaps: dict[str, int] = field(default_factory=dict)   # "fp->w4" -> count
    total_copy_s: float = 0.0
    total_latency_s: float = 0.0
    last: SwapRecord | None = None
    num_failed_copies: int = 0        # copies that failed: the layer stayed where it was, the slot went back
    last_failure: str | None = None


class LayerSwapper:
    def __init__(self, layers: nn.ModuleList, store: LayerStore, arena: PageArena, weights, copier,
                 make_room: Callable[[int, bool, int], bool]):
        """weights: PlacedWeights or ShardedWeights (fp_region(layer), slot(layer, precision)). make_room(nbytes,
        keep_headroom, returned_at_switch) -> True when the budget has nbytes free now and, when keep_headroom, the
        headroom free once the switch has given back the source's returned_at_switch bytes; a swap that does not
        fit waits (the control plane detaches free KV blocks for it)."""
        self.layers = layers
        self.store = store
        self.arena = arena
        self.weights = weights
        self.copier = copier
        self.make_room = make_room
        self.precision = ["fp"] * store.num_layers   # what each layer runs now
        self._target: dict[int, str] = {}            # wanted precision for layers with pending work
        self._jobs: dict[int, _Job] = {}             # at most one job per layer
        self.counters = SwapCounters()

    # ---- requests (step-boundary thread) ----
    def request(self, layer: int, precision: str) -> None:
        if not 0 <= layer < self.store.num_layers:
            raise ValueError(f"layer {layer} is out of range: this model has layers 0..{self.store.num_layers - 1}")
        if not self.store.has(precision):
            raise ValueError(f"precision {precision!r} is not available; this model has {list(self.store.precisions)}")
        job = self._jobs.get(layer)
        if job is not None and job.copy is None:
            del self._jobs[layer]  # not started yet: retarget freely
            job = None
        if job is None and precision == self.precision[layer]:
            self._target.pop(layer, None)
            return
        self._target[layer] = precision
        if job is None:
            self._jobs[layer] = _Job(layer, self.precision[layer], precision, time.perf_counter())

    def target(self, layer: int) -> str:
        return self._target.get(layer, self.precision[layer])

    @property
    def busy(self) -> bool:
        return bool(self._jobs)

    @property
    def waiting_for_room(self) -> bool:
        return any(j.waiting_for_room for j in self._jobs.values())

    def pending_layers(self) -> list[int]:
        """Layers whose wanted precision is not in effect yet (queued, copying, or waiting for KV blocks)."""
        return sorted(set(self._target) | set(self._jobs))

    def in_flight(self) -> list[int]:
        return [j.layer for j in self._jobs.values() if j.copy is not None]

    # ---- the state machine ----
    def region(self, layer: int, precision: str) -> ArenaRange:
        return self.weights.fp_region(layer) if precision == "fp" else self.weights.slot(layer, precision)

    def poll(self) -> list[SwapRecord]:
        """Switch layers whose copy finished, then start queued swaps. Call only at a step boundary."""
        finished = [j for j in self._jobs.values() if j.copy is not None and j.copy.done()]
        records = []
        if finished:
            self.copier.sync_compute()
        for job in finished:
            record = self._switch(job)
            if record is not None:
                records.append(record)
        for job in sorted(self._jobs.values(), key=lambda j: j.requested_at):
            if job.copy is None:
                self._start(job)
        return records

    def _start(self, job: _Job) -> None:
        dst = self.region(job.layer, job.dst)
        # A quantized slot may use the headroom; a restore to fp must leave it free for the next morph once the
        # quantized slot it leaves is given back at the switch. Counting that slot matters where the fp KV cache is
        # smaller than a slot: demanding the whole headroom beside both copies would wait forever for the last
        # restore (the copy borrows the headroom only until its switch).
        if not self.make_room(dst.nbytes, job.dst == "fp", self.region(job.layer, job.src).nbytes):
            job.waiting_for_room = True  # a swap that would need live KV blocks waits for them to free up
            return
        try:
            self.arena.commit(dst.offset, dst.nbytes)
        except MemoryBudgetExceeded:
            job.waiting_for_room = True
            return
        job.waiting_for_room = False
        image = self.store.image(job.layer, job.dst)
        target = self.arena.view(dst.offset, (image.nbytes,), torch.uint8)  # [nbytes]
        job.copy = self.copier.submit(target, image.data)

    def _switch(self, job: _Job) -> SwapRecord | None:
        try:
            job.copy.raise_if_failed()
        except Exception as exc:  # noqa: BLE001 - whatever the copy thread raised, it ends here, once
            self._fail(job, exc)
            return None
        self.layers[job.layer] = self.store.module(job.layer, job.dst)
        src = self.region(job.layer, job.src)
        self.arena.decommit(src.offset, src.nbytes)
        self.precision[job.layer] = job.dst
        del self._jobs[job.layer]
        record = SwapRecord(job.layer, job.src, job.dst, job.copy.nbytes, job.copy.seconds,
                            time.perf_counter() - job.requested_at, src.nbytes)
        key = f"{job.src}->{job.dst}"
        c = self.counters
        c.num_swaps[key] = c.num_swaps.get(key, 0) + 1
        c.total_copy_s += record.copy_s
        c.total_latency_s += record.latency_s
        c.last = record
        # A newer request for this layer arrived while the copy ran: chain the next swap.
        wanted = self._target.get(job.layer)
        if wanted is None or wanted == job.dst:
            self._target.pop(job.layer, None)
        else:
            self._jobs[job.layer] = _Job(job.layer, job.dst, wanted, time.perf_counter())
        log.debug("layer %d %s -> %s: copy %.1f ms, latency %.1f ms", job.layer, job.src, job.dst,
                  record.copy_s * 1e3, record.latency_s * 1e3)
        return record

    def _fail(self, job: _Job, exc: BaseException) -> None:
        """A copy that failed: the layer keeps serving at its precision, the destination's pages go back, the job
        and its target are dropped (a later request may try again), and the failure is counted and logged once
        rather than raised at every step boundary."""
        dst = self.region(job.layer, job.dst)
        self.arena.decommit(dst.offset, dst.nbytes)
        del self._jobs[job.layer]
        self._target.pop(job.layer, None)
        self.counters.num_failed_copies += 1
        self.counters.last_failure = f"layer {job.layer} {job.src}->{job.dst}: {type(exc).__name__}: {exc}"
        log.error("precision swap failed, layer %d stays %s: %s", job.layer, job.src, self.counters.last_failure)

    def wait_copies(self) -> None:
        """Block until every started copy finished (for callers that own the model, e.g. offline to_precision)."""
        for job in list(self._jobs.values()):
            if job.copy is not None:
                job.copy.wait()
