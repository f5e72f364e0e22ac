"""Prometheus metrics of a deployment: topology, reshapes (outcome, duration, KV moved, peak extra bytes) and worker
replacements, on the deployment's registry next to the engines' own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PIPELINE_PARTS = ("busy_s", "wall_s", "gap_s", "recv_s", "flush_s")
RESHAPE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DeploymentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.instances = Gauge("elastic_hf_instances", "Serving instances by TP and PP degree", ["tp", "pp"],
                               registry=r)
        self._instance_shapes: set[tuple[str, str]] = set()
        self.bubble_ratio = Gauge("elastic_hf_pipeline_bubble_ratio",
                                  "Share of the last pipelined step a stage spent waiting (1 - busy / wall)",
                                  ["instance_workers", "stage"], registry=r)
        self.activation_bytes = Counter("elastic_hf_pipeline_activation_bytes",
                                        "Hidden-state bytes sent between pipeline stages", registry=r)
        self.reshapes = Counter("elastic_hf_reshapes", "Reshapes (TP layout changes) by outcome", ["outcome"],
                                registry=r)
        for outcome in ("committed", "rolled_back"):
            self.reshapes.labels(outcome=outcome)
        self.reshape_seconds = Histogram("elastic_hf_reshape_seconds", "Committed reshape duration",
                                         buckets=RESHAPE_BUCKETS, registry=r)
        self.kv_moved_bytes = Counter("elastic_hf_reshape_kv_moved_bytes", "KV bytes sent between workers by reshapes",
                                      registry=r)
        self.peak_extra_bytes = Gauge("elastic_hf_reshape_peak_extra_bytes",
                                      "Largest per-worker extra KV bytes of the last reshape", registry=r)
        self.recoveries = Counter("elastic_hf_worker_replacements", "Dead worker processes replaced", registry=r)
        # where each stage's time went, summed over steps: {stage: {"busy_s" (forwards), "wall_s", "gap_s" (idle
        # between its steps: the control plane), "recv_s" (waiting for upstream), "flush_s" (its sends)}}
        self.pipeline_stage_s: dict[int, dict[str, float]] = {}

    @property
    def pipeline_busy_s(self) -> float:
        """Forward time summed over stages and steps: 1 - busy / wall is the overall bubble ratio."""
        return sum(parts["busy_s"] for parts in self.pipeline_stage_s.values())

    @property
    def pipeline_wall_s(self) -> float:
        return sum(parts["wall_s"] for parts in self.pipeline_stage_s.values())

    def set_topology(self, topology) -> None:
        """Instances of the current topology by (tp, pp); shapes that no longer serve read 0."""
        counts: dict[tuple[str, str], int] = {}
        for shape in topology.shapes:
            key = (str(shape.tp), str(shape.pp))
            counts[key] = counts.get(key, 0) + 1
        self._instance_shapes |= set(counts)
        for tp, pp in self._instance_shapes:
            self.instances.labels(tp=tp, pp=pp).set(counts.get((tp, pp), 0))

    def on_pipeline_step(self, stage_stats: list[dict], workers: tuple[int, ...]) -> None:
        """Stage timings of one pipelined step (every worker of the instance, stage order)."""
        name = "-".join(map(str, workers))
        for stats in stage_stats:
            parts = self.pipeline_stage_s.setdefault(stats["stage"], dict.fromkeys(PIPELINE_PARTS, 0.0))
            for key in PIPELINE_PARTS:
                parts[key] += stats[key]
            self.bubble_ratio.labels(instance_workers=name, stage=str(stats["stage"])).set(stats["bubble_ratio"])
            self.activation_bytes.inc(stats["sent_bytes"])

    def on_reshape(self, committed: bool, seconds: float, worker_stats: list[dict]) -> None:
        self.reshapes.labels(outcome="committed" if committed else "rolled_back").inc()
        if not committed:
            return
        self.reshape_seconds.observe(seconds)
        kv = [s["kv"] for s in worker_stats if s.get("kv")]
        self.kv_moved_bytes.inc(sum(k["sent_bytes"] for k in kv))
        self.peak_extra_bytes.set(max((k["peak_extra_bytes"] for k in kv), default=0))

    def render(self) -> bytes:
        return generate_latest(self.registry)
