"""Prometheus metrics of one engine.

Each engine owns its own `CollectorRegistry` so that several engines in one process (tests, multi-instance
routers) never collide on metric names; `/metrics` renders exactly this registry.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets sized for CPU serving of small models (ms..tens of s) and for GPUs (sub-ms TPOT).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self, model_id: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests_arrived = Counter("elastic_hf_requests", "Requests accepted by the engine", registry=r)
        self.requests_finished = Counter("elastic_hf_requests_finished", "Finished requests by finish reason",
                                         ["finish_reason"], registry=r)
        for reason in FINISH_REASONS:  # export zeros so dashboards see every series from the start
            self.requests_finished.labels(finish_reason=reason)
        self.prompt_tokens = Counter("elastic_hf_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.generation_tokens = Counter("elastic_hf_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("elastic_hf_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("elastic_hf_time_per_output_token_seconds",
                              "Time between consecutive output tokens of one request",
                              buckets=TPOT_BUCKETS, registry=r)
        self.preemptions = Counter("elastic_hf_preemptions", "Requests preempted (recompute) for lack of KV blocks",
                                   registry=r)
        self.kv_blocks_used = Gauge("elastic_hf_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("elastic_hf_kv_blocks_total", "KV cache blocks attached", registry=r)
        self.num_waiting = Gauge("elastic_hf_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.num_running = Gauge("elastic_hf_num_requests_running", "Requests in the running batch", registry=r)
        self.info = Gauge("elastic_hf_model_info", "Served model (value is always 1)", ["model_id"], registry=r)
        if model_id:
            self.info.labels(model_id=model_id).set(1)

    # ---- called by the engine (engine thread only) ----
    def on_request_arrived(self) -> None:
        self.requests_arrived.inc()

    def on_prompt_tokens(self, n: int) -> None:
        if n > 0:
            self.prompt_tokens.inc(n)

    def on_generation_tokens(self, n: int) -> None:
        if n > 0:
            self.generation_tokens.inc(n)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(max(0.0, seconds))

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(max(0.0, seconds))

    def on_preemption(self, n: int = 1) -> None:
        if n > 0:
            self.preemptions.inc(n)

    def set_kv_blocks(self, used: int, total: int) -> None:
        self.kv_blocks_used.set(used)
        self.kv_blocks_total.set(total)

    def set_queue(self, num_waiting: int, num_running: int) -> None:
        self.num_waiting.set(num_waiting)
        self.num_running.set(num_running)

    def on_request_finished(self, finish_reason: str | None) -> None:
        self.requests_finished.labels(finish_reason=finish_reason or "unknown").inc()

    # ---- read side ----
    def render(self) -> bytes:
        """Prometheus text exposition of this engine's registry."""
        return generate_latest(self.registry)
