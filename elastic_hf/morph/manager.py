"""MorphManager: the control plane of precision morphing for one worker's TP-1 instance (`ElasticModel.morph`,
`/admin/morph`). At every step boundary of that instance's engine it asks the controller (if any) for a decision,
sends swaps and detached KV blocks to the worker's MorphExecutor as a MorphCommand, and attaches the blocks the
worker committed to the engine's KV manager (the instance's one owner of KV capacity, kv/kv_manager.py). With nothing to do it sends nothing: a boundary costs no RPC.

Threads: everything that touches the worker runs on the thread that drives `engine.step()`. With no driver
(offline use: the caller's thread steps the engine) `to_precision` runs at once in the caller's thread, which is a
step boundary by construction. With a driver (the server's engine thread), `attach_driver(wake)` makes
`to_precision` queue the change, wake the engine, and wait for it."""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from elastic_hf.morph.controller import MorphController, MorphDecision
from elastic_hf.morph.executor import MorphCommand, MorphInfo, MorphReport
from elastic_hf.morph.layer_swapper import SwapRecord
from elastic_hf.morph.metrics import MorphMetrics
from elastic_hf.morph.monitor import ServingSample
from elastic_hf.units import ceil_div

log = logging.getLogger(__name__)

MAX_OFFLINE_SYNCS = 10_000   # bound on the offline swap loop (each round waits for copies, so this is never hit)


class MorphManager:
    def __init__(self, send: Callable, worker: int, info: MorphInfo, mode: str, order: list[int],
                 controller: MorphController | None, metrics: MorphMetrics | None = None):
        """send(method, *args): the RPC entry point of the worker ("morph.sync", MorphCommand) -> MorphReport."""
        self.send = send
        self.worker = worker
        self.info = info
        self.mode = mode
        self.order = list(order)
        self.controller = controller
        self.metrics = metrics
        self.num_layers = info.num_layers
        self.engine = None                 # the LLMEngine of the worker's instance while it is TP1
        # Guards the cached report and the forced queue between the driver thread (boundaries) and callers of
        # state() and to_precision() on other threads (the admin API).
        self._lock = threading.RLock()
        self._done = threading.Condition(self._lock)
        self._forced: list[tuple[list[int], str]] = []
        self._wake: Callable[[], None] | None = None
        self._report: MorphReport | None = None
        self.num_attached = 0              # KV blocks attached / detached by morphs (cumulative)
        self.num_detached = 0
        self.recent_swaps: deque[SwapRecord] = deque(maxlen=64)
        self.decisions: deque[tuple[float, MorphDecision]] = deque(maxlen=64)
        # (time, kv blocks attached, layers per precision) whenever it changes: the benchmark's timeline plot.
        self.timeline: list[tuple[float, int, dict[str, int]]] = []
        self.boundary_error: str | None = None
        if metrics is not None:
            metrics.set_host_store(worker, info.host_store["host_bytes"])

    # ------------------------------------------------------------------ wiring
    def bind(self, engine) -> None:
        """Serve the instance `engine` drives (None: the worker's instance is not TP1, morphing pauses)."""
        if self.engine is not None:
            self.engine.step_boundary_hooks.remove(self.on_step_boundary)
            self.engine.idle_work_checks.remove(self.has_pending_work)
        self.engine = engine
        if engine is None:
            return
        engine.step_boundary_hooks.append(self.on_step_boundary)
        engine.idle_work_checks.append(self.has_pending_work)
        with self._lock:
            self._sync([])
        self._record_timeline()

    def attach_driver(self, wake: Callable[[], None]) -> None:
        """Another thread drives engine.step() from now on; wake() makes it run a step boundary soon."""
        self._wake = wake

    @property
    def kv(self):
        """The KV manager of the bound instance."""
        return self.engine.scheduler.kv

    # ------------------------------------------------------------------ control API
    def _validate(self, layers: int | Iterable[int] | str, precision: str) -> list[int]:
        if precision not in self.info.precisions:
            raise ValueError(f"precision {precision!r} is unknown; allowed: {', '.join(self.info.precisions)}")
        if layers == "all":
            return list(range(self.num_layers))
        if isinstance(layers, int):
            layers = [layers]
        if isinstance(layers, str):
            raise ValueError(f"layers must be a list of layer indices or 'all', got {layers!r}")
        out = []
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
                raise ValueError(f"layer {layer!r} does not exist: this model has layers 0..{self.num_layers - 1}")
            out.append(layer)
        return out

    def to_precision(self, layers: int | Iterable[int] | str, precision: str, *, wait: bool = True,
                     timeout: float = 120.0, controller: bool | None = None) -> dict:
        """Force `layers` ("all", an index or a list) to `precision` ("fp", "w8", "w4"). A forced state turns the
        automatic controller off unless controller=True (set_controller(True) turns it back on). Returns state().
        A restore to fp that needs KV blocks still in use stays pending until they free up (state()["pending"]).
        With a driver attached, do not call it with wait=True from the driver's own thread (a step hook): the
        change is applied by that thread's next step boundary."""
        layers = self._validate(layers, precision)
        if self.engine is None:
            raise ValueError(f"worker {self.worker}'s instance is not TP1: precision morphing runs on TP-1 instances; "
                             "reshape it back first")
        if self.controller is not None:
            self.controller.enabled = bool(controller)
        if self._wake is None:
            with self._lock:
                self._drive_offline([(layers, precision)])
            return self.state()
        with self._lock:
            self._forced.append((layers, precision))
            self.boundary_error = None
        self._wake()
        if wait:
            deadline = time.monotonic() + timeout
            with self._done:
                while not self._reached(layers, precision):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._done.wait(min(left, 0.5))
                    if self.boundary_error:
                        raise RuntimeError(f"morph failed on the engine thread: {self.boundary_error}")
        return self.state()

    def restore_now(self) -> dict:
        """Every layer back to fp at once, in the calling thread, which must be the driver's at a step boundary
        (a reshape's quiesce point). A restore that needs KV blocks still in use stays pending. Returns state()."""
        with self._lock:
            self._drive_offline([(list(range(self.num_layers)), "fp")])
            return self._state()

    def set_controller(self, enabled: bool) -> None:
        if self.controller is None:
            raise ValueError(f"morph mode {self.mode!r} has no automatic controller; load with morph='default', "
                             "'accuracy' or 'performance'")
        self.controller.enabled = enabled
        if self._wake is not None:
            self._wake()

    def _reached(self, layers: list[int], precision: str) -> bool:
        if self._forced:
            return False
        report = self._report
        if any(report.precisions[i] != precision for i in layers):
            # Pending only because it waits for live KV blocks: do not block the caller on other requests.
            return self._waits_for_live_blocks(report)
        return True

    def _waits_for_live_blocks(self, report: MorphReport) -> bool:
        return (report.room_needed_bytes > 0 and not report.in_flight
                and not self._can_detach(report.room_needed_bytes))

    def _drive_offline(self, requests: list[tuple[list[int], str]]) -> None:
        """Run the swaps to completion in this thread (no forward can run meanwhile)."""
        report = self._sync(requests)
        for _ in range(MAX_OFFLINE_SYNCS):
            if not report.busy or self._waits_for_live_blocks(report):
                break  # done, or waiting for KV blocks that are still in use
            report = self._sync([], wait_copies=report.in_flight)
        self._record_timeline()

    # ------------------------------------------------------------------ the worker round trip
    def _blocks_for(self, nbytes: int) -> int:
        return ceil_div(nbytes, self.info.block_bytes)

    def _can_detach(self, nbytes: int) -> bool:
        return self.kv.num_free >= self._blocks_for(nbytes)

    def _sync(self, requests: list[tuple[list[int], str]], wait_copies: bool = False) -> MorphReport:
        """One MorphCommand, and a second one at once when a swap reported that it waits for room the free KV
        blocks can give: the KV manager gives those up (all or nothing: shrinking the cache for a swap that still
        cannot start only hurts; the pool decommits them) and the command goes again, so the swap starts at this
        boundary like on a single process. Spare budget the report shows goes to the KV manager as new blocks."""
        report = self._send(requests, wait_copies)
        changed = bool(report.records)
        needed = report.room_needed_bytes
        if needed > 0 and self._can_detach(needed):
            self.num_detached += len(self.kv.shrink(self._blocks_for(needed)))
            report = self._send([], False)
            changed = True
        grown = len(self.kv.grow(report.spare_blocks)) if report.spare_blocks else 0
        if grown:
            self.num_attached += grown
            nbytes = grown * self.info.block_bytes
            report = dataclasses.replace(report, spare_blocks=0, kv_blocks=report.kv_blocks + grown,
                                         kv_committed_bytes=report.kv_committed_bytes + nbytes,
                                         budget_free_bytes=report.budget_free_bytes - nbytes)
        self._report = report
        if changed or grown:
            self._record_timeline()
        self._publish()
        return report

    def _send(self, requests, wait_copies: bool) -> MorphReport:
        report = self.send("morph.sync", MorphCommand(list(requests), wait_copies))
        self._report = report
        if report.records:
            # Layers switched precision: KV cached under the old weights would differ from what the new ones compute,
            # so the prefix cache starts a new epoch (exact outputs, as without a cache; kv/prefix_cache.py).
            self.kv.reset_prefix_cache()
        for record in report.records:
            self.recent_swaps.append(record)
            if self.metrics is not None:
                self.metrics.on_swap(self.worker, record)
        return report

    # ------------------------------------------------------------------ step boundary
    def has_pending_work(self) -> bool:
        """True while the engine should keep stepping without requests: swaps in flight, forced changes, or
        layers below fp that the controller may restore once the load is gone."""
        report = self._report
        if self._forced or (report is not None and report.busy):
            return True
        controller = self.controller
        return (controller is not None and controller.enabled and report is not None
                and any(p != "fp" for p in report.precisions))

    def on_step_boundary(self, engine) -> None:
        with self._done:
            self._boundary(engine)
            self._done.notify_all()

    def _boundary(self, engine) -> None:
        try:
            forced, self._forced = self._forced, []
            report = self._report
            if forced or report.busy:
                # With no request waiting on this engine, wait for running copies instead of spinning idle steps
                # (which would also starve the copy thread of the GIL).
                report = self._sync(forced, wait_copies=report.in_flight and not engine.requests)
            if self.controller is not None:
                # Only running copies count as busy: a restore that waits for KV blocks must not freeze the
                # controller (if pressure returns, the controller re-targets that layer and the restore is dropped).
                decision = self.controller.decide(self.sample(engine), report.targets, report.in_flight)
                if decision is not None:
                    self._log_decision(decision)
                    self._sync([(decision.layers, decision.precision)])
        except Exception as exc:
            # A failed morph must not fail the step: the model is consistent (a layer switches only after its
            # copy finished), requests keep running, and the error is reported in state() and the log.
            self.boundary_error = f"{type(exc).__name__}: {exc}"
            log.exception("morph step boundary failed on worker %d", self.worker)

    def _log_decision(self, decision: MorphDecision) -> None:
        log.info("morph controller (worker %d): %s layers %s -> %s (%s)", self.worker, decision.kind,
                 decision.layers, decision.precision, decision.reason)
        self.decisions.append((time.time(), decision))
        if self.metrics is not None:
            self.metrics.on_decision(self.worker, decision.kind)

    @staticmethod
    def sample(engine) -> ServingSample:
        """What the controller sees: KV use, queue, and TTFT / TPOT of the tokens since the last boundary."""
        load = engine.load_snapshot()
        return ServingSample(time.monotonic(), load.kv_blocks_used, load.kv_blocks_total, load.num_waiting,
                             load.num_running, load.queue_delay_s, load.blocked_on_kv, load.ttft_s, load.tpot_s)

    # ------------------------------------------------------------------ visibility
    def counts(self) -> dict[str, int]:
        out = {p: 0 for p in self.info.precisions}
        for p in self._report.precisions:
            out[p] += 1
        return out

    def _record_timeline(self) -> None:
        if self._report is not None:
            self.timeline.append((time.time(), self._report.kv_blocks, self.counts()))

    def _publish(self) -> None:
        if self.metrics is None:
            return
        report = self._report
        self.metrics.set_state(self.worker, self.counts(), report.kv_blocks,
                               report.kv_blocks * self._block_size(), report.weights_committed_bytes,
                               report.counters.num_failed_copies)

    def _block_size(self) -> int:
        return self.engine.scheduler.block_size if self.engine is not None else 0

    def state(self) -> dict:
        """Per-layer precision, KV capacity, swap counts and times (GET /admin/morph)."""
        with self._lock:
            return self._state()

    def _state(self) -> dict:
        report = self._report
        counters = report.counters
        num_swaps = sum(counters.num_swaps.values())
        last = counters.last
        kv = self.kv if self.engine is not None else None
        return {
            "worker": self.worker,
            "mode": self.mode,
            "active": self.engine is not None,
            "controller_enabled": bool(self.controller is not None and self.controller.enabled),
            "precisions": list(self.info.precisions),
            "layers": [{"layer": i, "precision": report.precisions[i], "target": report.targets[i]}
                       for i in range(self.num_layers)],
            "layer_counts": self.counts(),
            "pending": list(report.pending_layers),
            "waiting_for_kv_blocks": kv is not None and self._waits_for_live_blocks(report),
            "order": self.order,
            "kv_blocks_total": report.kv_blocks,
            "kv_blocks_used": kv.num_used if kv is not None else None,
            "kv_capacity_tokens": report.kv_blocks * self._block_size(),
            "kv_block_bytes": self.info.block_bytes,
            "weights_committed_bytes": report.weights_committed_bytes,
            "kv_committed_bytes": report.kv_committed_bytes,
            "budget_bytes": report.budget_bytes,
            "budget_free_bytes": report.budget_free_bytes,
            "headroom_bytes": report.headroom_bytes,
            "swaps": dict(counters.num_swaps),
            "num_swaps": num_swaps,
            "num_failed_copies": counters.num_failed_copies,
            "last_failed_copy": counters.last_failure,
            "swap_copy_s_total": round(counters.total_copy_s, 6),
            "swap_latency_s_mean": round(counters.total_latency_s / num_swaps, 6) if num_swaps else None,
            "last_swap": None if last is None else {
                "layer": last.layer, "src": last.src, "dst": last.dst, "copy_s": round(last.copy_s, 6),
                "latency_s": round(last.latency_s, 6), "bytes_copied": last.nbytes_copied},
            # Cumulative since start (a block attached then detached again counts in both).
            "kv_blocks_attached_by_morphs": self.num_attached,
            "kv_blocks_detached_by_morphs": self.num_detached,
            "host_store": self.info.host_store,
            "last_error": self.boundary_error,
        }

    def gain_left_blocks(self) -> int:
        """KV blocks the controller could still add by morphing every fp layer it may move to its precision (0
        without a controller or a bound instance): the overload arbiter's estimate of what morphing can absorb."""
        report, controller = self._report, self.controller
        if controller is None or report is None or self.engine is None:
            return 0
        precision = controller.config.precision
        cap = controller.config.max_layers if controller.config.max_layers is not None else self.num_layers
        movable = max(0, cap - sum(p != "fp" for p in report.precisions))
        fp_layers = sum(p == "fp" for p in report.precisions)
        return min(movable, fp_layers) * self.info.blocks_per_layer.get(precision, 0)

    def is_full_precision(self) -> bool:
        report = self._report
        return report is None or (not report.busy and all(p == "fp" for p in report.precisions))
