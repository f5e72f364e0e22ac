"""MorphManager (`ElasticModel.morph`): the morphing executor of one engine. At every step boundary it applies
forced morphs, switches layers whose copies finished, asks the controller (if any) for a decision, starts the
swaps, and grows the KV cache with the bytes the weights gave up.

Threads: everything that touches the model runs on the thread that drives `engine.step()`. With no driver
(offline use, the caller's own thread steps the engine) `to_precision` executes at once in the caller's
thread, which is a step boundary by construction. With a driver (the server's engine thread),
`attach_driver(wake)` makes `to_precision` queue the change, wake the engine, and wait for it."""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from elastic_hf.morph.controller import MorphController, MorphDecision
from elastic_hf.morph.kv_resizer import KVResizer
from elastic_hf.morph.layer_swapper import LayerSwapper, SwapRecord
from elastic_hf.morph.monitor import ServingSample

log = logging.getLogger(__name__)


class MorphManager:
    def __init__(self, engine, swapper: LayerSwapper, resizer: KVResizer, controller: MorphController | None,
                 mode: str, order: list[int], metrics=None):
        self.engine = engine
        self.swapper = swapper
        self.resizer = resizer
        self.controller = controller
        self.mode = mode
        self.order = list(order)
        self.metrics = metrics
        self.num_layers = swapper.store.num_layers
        # Guards swapper/controller state between the engine thread (boundaries) and callers of state() and
        # to_precision() on other threads (the admin API).
        self._lock = threading.RLock()
        self._done = threading.Condition(self._lock)
        self._forced: list[tuple[list[int], str]] = []
        self._wake: Callable[[], None] | None = None
        self._ttft_seen: set[str] = set()
        self._last_token: dict[str, float] = {}
        self.recent_swaps: deque[SwapRecord] = deque(maxlen=64)
        self.decisions: deque[tuple[float, MorphDecision]] = deque(maxlen=64)
        # (time, kv blocks attached, layers per precision) whenever it changes: the benchmark's timeline plot.
        self.timeline: list[tuple[float, int, dict[str, int]]] = []
        self.boundary_error: str | None = None
        engine.step_boundary_hooks.append(self.on_step_boundary)
        engine.idle_work_checks.append(self.has_pending_work)
        self._record_timeline()
        self._publish()

    # ------------------------------------------------------------------ control API
    def attach_driver(self, wake: Callable[[], None]) -> None:
        """Another thread drives engine.step() from now on; wake() makes it run a step boundary soon."""
        self._wake = wake

    def _validate(self, layers: int | Iterable[int] | str, precision: str) -> list[int]:
        store = self.swapper.store
        if precision not in store.precisions:
            raise ValueError(f"precision {precision!r} is unknown; allowed: {', '.join(store.precisions)}")
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
        if self.controller is not None:
            self.controller.enabled = bool(controller)
        if self._wake is None:
            with self._lock:
                self._apply_now(layers, precision)
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
        if any(self.swapper.precision[i] != precision for i in layers):
            # Pending only because it waits for live KV blocks: do not block the caller on other requests.
            return self.swapper.waiting_for_room and not self.swapper.in_flight()
        return True

    def _apply_now(self, layers: list[int], precision: str) -> None:
        for layer in layers:
            self.swapper.request(layer, precision)
        self._drive_swaps()

    def _drive_swaps(self) -> None:
        """Run the swap state machine to completion in this thread (no forward can run meanwhile)."""
        while True:
            self._on_records(self.swapper.poll())
            if not self.swapper.waiting_for_room:
                self.resizer.grow()
            if not self.swapper.in_flight():
                if not self.swapper.busy or self.swapper.waiting_for_room:
                    break
            self.swapper.wait_copies()
        self._record_timeline()
        self._publish()

    # ------------------------------------------------------------------ step boundary
    def has_pending_work(self) -> bool:
        """True while the engine should keep stepping without requests: swaps in flight, forced changes, or
        layers below fp that the controller may restore once the load is gone."""
        if self._forced or self.swapper.busy:
            return True
        controller = self.controller
        return controller is not None and controller.enabled and any(p != "fp" for p in self.swapper.precision)

    def on_step_boundary(self, engine) -> None:
        with self._done:
            self._boundary(engine)
            self._done.notify_all()

    def _boundary(self, engine) -> None:
        try:
            forced, self._forced = self._forced, []
            for layers, precision in forced:
                for layer in layers:
                    self.swapper.request(layer, precision)
            self._on_records(self.swapper.poll())
            if self.controller is not None:
                # Only running copies count as busy: a restore that waits for KV blocks must not freeze the controller
                # (if pressure returns, the controller re-targets that layer and the restore is dropped).
                decision = self.controller.decide(self.sample(engine), self._targets(),
                                                  bool(self.swapper.in_flight()))
                if decision is not None:
                    self._execute(decision)
                    self._on_records(self.swapper.poll())
            if not self.swapper.waiting_for_room:
                if self.resizer.grow():
                    self._record_timeline()
            self._publish()
        except Exception as exc:
            # A failed morph must not fail the step: the model is consistent (a layer switches only after its
            # copy finished), requests keep running, and the error is reported in state() and the log.
            self.boundary_error = f"{type(exc).__name__}: {exc}"
            log.exception("morph step boundary failed")

    def _targets(self) -> list[str]:
        return [self.swapper.target(i) for i in range(self.num_layers)]

    def _execute(self, decision: MorphDecision) -> None:
        log.info("morph controller: %s layers %s -> %s (%s)", decision.kind, decision.layers, decision.precision,
                 decision.reason)
        self.decisions.append((time.time(), decision))
        if self.metrics is not None:
            self.metrics.decisions.labels(kind=decision.kind).inc()
        for layer in decision.layers:
            self.swapper.request(layer, decision.precision)

    def _on_records(self, records: list[SwapRecord]) -> None:
        for record in records:
            self.recent_swaps.append(record)
            if self.metrics is not None:
                self.metrics.on_swap(record)
        if records:
            self._record_timeline()

    def sample(self, engine) -> ServingSample:
        """What the controller sees: KV use, queue, and TTFT / TPOT of the tokens since the last boundary."""
        scheduler = engine.scheduler
        allocator = scheduler.allocator
        now = time.time()
        waiting = scheduler.waiting
        queue_delay = 0.0
        blocked = False
        if waiting:
            head = waiting[0]
            queue_delay = max(0.0, now - head.arrival_time)
            block_size = scheduler.config.block_size
            chunk = min(head.num_uncomputed_tokens, scheduler.config.max_num_batched_tokens)
            needed = -(-(head.num_computed_tokens + chunk) // block_size) - len(head.block_ids)
            blocked = not allocator.can_allocate(needed)
        ttfts, tpots = [], []
        live = engine.requests
        for request_id, request in live.items():
            if request.first_token_time is not None and request_id not in self._ttft_seen:
                self._ttft_seen.add(request_id)
                ttfts.append(request.first_token_time - request.arrival_time)
            last = request.last_token_time
            if last is not None:
                previous = self._last_token.get(request_id)
                if previous is not None and last != previous:
                    tpots.append(last - previous)
                self._last_token[request_id] = last
        if len(self._ttft_seen) > 2 * len(live) + 64:  # forget finished requests now and then
            self._ttft_seen &= live.keys()
            self._last_token = {k: v for k, v in self._last_token.items() if k in live}
        return ServingSample(time.monotonic(), allocator.num_used, allocator.num_total, len(waiting),
                             len(scheduler.running), queue_delay, blocked, ttfts, tpots)

    # ------------------------------------------------------------------ visibility
    def counts(self) -> dict[str, int]:
        out = {p: 0 for p in self.swapper.store.precisions}
        for p in self.swapper.precision:
            out[p] += 1
        return out

    def _record_timeline(self) -> None:
        self.timeline.append((time.time(), self.resizer.pool.num_blocks, self.counts()))

    def _publish(self) -> None:
        if self.metrics is None:
            return
        pool = self.resizer.pool
        self.metrics.set_state(self.counts(), pool.num_blocks, pool.num_blocks * pool.layout.block_size,
                               self.swapper.arena.committed_bytes)

    def state(self) -> dict:
        """Per-layer precision, KV capacity, swap counts and times (GET /admin/morph)."""
        with self._lock:
            return self._state()

    def _state(self) -> dict:
        swapper, pool = self.swapper, self.resizer.pool
        counters = swapper.counters
        num_swaps = sum(counters.num_swaps.values())
        budget = self.resizer.budget
        last = counters.last
        return {
            "mode": self.mode,
            "controller_enabled": bool(self.controller is not None and self.controller.enabled),
            "precisions": list(swapper.store.precisions),
            "layers": [{"layer": i, "precision": swapper.precision[i], "target": swapper.target(i)}
                       for i in range(self.num_layers)],
            "layer_counts": self.counts(),
            "pending": swapper.pending_layers(),
            "waiting_for_kv_blocks": swapper.waiting_for_room,
            "order": self.order,
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.allocator.num_used,
            "kv_capacity_tokens": pool.num_blocks * pool.layout.block_size,
            "kv_block_bytes": pool.layout.block_bytes,
            "weights_committed_bytes": swapper.arena.committed_bytes,
            "kv_committed_bytes": pool.committed_bytes,
            "budget_bytes": budget.total_bytes,
            "budget_free_bytes": budget.free_bytes,
            "headroom_bytes": self.resizer.headroom_bytes,
            "swaps": dict(counters.num_swaps),
            "num_swaps": num_swaps,
            "swap_copy_s_total": round(counters.total_copy_s, 6),
            "swap_latency_s_mean": round(counters.total_latency_s / num_swaps, 6) if num_swaps else None,
            "last_swap": None if last is None else {
                "layer": last.layer, "src": last.src, "dst": last.dst, "copy_s": round(last.copy_s, 6),
                "latency_s": round(last.latency_s, 6), "bytes_copied": last.nbytes_copied},
            "kv_blocks_attached_by_morphs": self.resizer.num_attached,
            "kv_blocks_detached_by_morphs": self.resizer.num_detached,
            "host_store": swapper.store.report(),
            "last_error": self.boundary_error,
        }
