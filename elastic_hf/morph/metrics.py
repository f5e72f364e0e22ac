"""Prometheus metrics of precision morphing, registered on the engine's registry so /metrics shows them. One set per
deployment; every series carries the `worker` whose layers it describes (each worker morphs its own)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SWAP_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class MorphMetrics:
    def __init__(self, registry: CollectorRegistry):
        r = self.registry = registry
        self.layers = Gauge("elastic_hf_morph_layers", "Decoder layers running at each precision",
                            ["worker", "precision"], registry=r)
        self.kv_capacity_blocks = Gauge("elastic_hf_morph_kv_capacity_blocks",
                                        "KV blocks attached (grows when layers are quantized)", ["worker"], registry=r)
        self.kv_capacity_tokens = Gauge("elastic_hf_morph_kv_capacity_tokens", "KV cache capacity in tokens",
                                        ["worker"], registry=r)
        self.weights_bytes = Gauge("elastic_hf_morph_weights_committed_bytes", "Committed weight bytes (ledger)",
                                   ["worker"], registry=r)
        self.swaps = Counter("elastic_hf_morph_swaps", "Layer swaps completed", ["worker", "src", "dst"], registry=r)
        self.swap_latency = Histogram("elastic_hf_morph_swap_latency_seconds",
                                      "Swap request to switch at a step boundary", ["worker", "dst"],
                                      buckets=SWAP_LATENCY_BUCKETS, registry=r)
        self.swap_copy = Histogram("elastic_hf_morph_swap_copy_seconds", "Host-to-arena copy time of one swap",
                                   ["worker", "dst"], buckets=SWAP_LATENCY_BUCKETS, registry=r)
        self.decisions = Counter("elastic_hf_morph_decisions", "Controller decisions", ["worker", "kind"],
                                 registry=r)
        self.failed_copies = Gauge("elastic_hf_morph_failed_copies", "Swap copies that failed since start (the "
                                   "layer stayed at its precision, the slot was released)", ["worker"], registry=r)
        self.host_store_bytes = Gauge("elastic_hf_morph_host_store_bytes", "Layer variants held in host memory",
                                      ["worker", "precision"], registry=r)

    def on_swap(self, worker: int, record) -> None:
        w = str(worker)
        self.swaps.labels(worker=w, src=record.src, dst=record.dst).inc()
        self.swap_latency.labels(worker=w, dst=record.dst).observe(record.latency_s)
        self.swap_copy.labels(worker=w, dst=record.dst).observe(record.copy_s)

    def on_decision(self, worker: int, kind: str) -> None:
        self.decisions.labels(worker=str(worker), kind=kind).inc()

    def set_state(self, worker: int, counts: dict[str, int], kv_blocks: int, kv_tokens: int,
                  weights_bytes: int, failed_copies: int = 0) -> None:
        w = str(worker)
        self.failed_copies.labels(worker=w).set(failed_copies)
        for precision, n in counts.items():
            self.layers.labels(worker=w, precision=precision).set(n)
        self.kv_capacity_blocks.labels(worker=w).set(kv_blocks)
        self.kv_capacity_tokens.labels(worker=w).set(kv_tokens)
        self.weights_bytes.labels(worker=w).set(weights_bytes)

    def set_host_store(self, worker: int, host_bytes: dict[str, int]) -> None:
        for precision, n in host_bytes.items():
            self.host_store_bytes.labels(worker=str(worker), precision=precision).set(n)
