"""Prometheus metrics of the overload responses (engine/overload.py): decisions, the response in effect, the KV
demand ratio, parameter drops and the weight bytes they freed per worker, the coordinated KV exchange (bytes,
seconds, requests stalled on it) and the lookahead cost model's error, on the deployment's registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from elastic_hf.engine.overload import OVERLOAD_RESPONSES


class OverloadMetrics:
    def __init__(self, registry: CollectorRegistry, num_workers: int):
        r = registry
        self.decisions = Counter("elastic_hf_overload_decisions", "Overload arbiter decisions by action and outcome",
                                 ["action", "outcome"], registry=r)
        self.active = Gauge("elastic_hf_overload_active_response", "1 for the overload response in effect",
                            ["response"], registry=r)
        for response in OVERLOAD_RESPONSES[1:4]:
            self.active.labels(response=response).set(0)
        self.demand_ratio = Gauge("elastic_hf_kv_demand_ratio",
                                  "KV demand (running + queued requests' blocks) / attached KV capacity", registry=r)
        self.drops = Counter("elastic_hf_param_drops", "Parameter drops (KunServe) by outcome", ["outcome"],
                             registry=r)
        for outcome in ("committed", "refused", "rolled_back", "restored"):
            self.drops.labels(outcome=outcome)
        self.dropped_bytes = Gauge("elastic_hf_dropped_weight_bytes",
                                   "Weight bytes a worker gave up to its KV cache (parameter drop or TP merge)",
                                   ["worker"], registry=r)
        for w in range(num_workers):
            self.dropped_bytes.labels(worker=str(w)).set(0)
        self.exchange_bytes = Counter("elastic_hf_kv_exchange_bytes", "KV bytes sent by coordinated exchanges",
                                      registry=r)
        self.exchange_seconds = Counter("elastic_hf_kv_exchange_seconds",
                                        "Seconds of KV exchange transfer on the busiest worker (beside the steps)",
                                        registry=r)
        self.exchanging = Gauge("elastic_hf_requests_exchanging",
                                "Sequences stalled while their KV is exchanged", registry=r)
        self.cost_model_error = Gauge("elastic_hf_cost_model_error",
                                      "Relative error of the lookahead cost model on the last pipelined step",
                                      registry=r)

    def set_active(self, response: str | None) -> None:
        for name in OVERLOAD_RESPONSES[1:4]:
            self.active.labels(response=name).set(1 if name == response else 0)

    def on_exchange_progress(self, sent_bytes: int, seconds: float) -> None:
        self.exchange_bytes.inc(sent_bytes)
        self.exchange_seconds.inc(seconds)
