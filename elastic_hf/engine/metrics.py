"""Prometheus metrics of one engine, or of a deployment's engines together (they share one EngineMetrics).

Each EngineMetrics owns its own `CollectorRegistry` so that several engines in one process (tests, multi-instance
routers) never collide on metric names; `/metrics` renders exactly this registry. Every event feeds two sets of
names there:

- ours, `elastic_hf_*`, unlabelled but for the finish reason (the model is in `elastic_hf_model_info`);
- vLLM's, `vllm:*`, with vLLM's labels `model_name` (the served model name) and `engine` ("0": the deployment
  is one engine core in vLLM's terms), vLLM's buckets and vLLM's semantics (vllm/v1/metrics/loggers.py), so
  dashboards, alerts and autoscalers written for vLLM read elastic-hf unchanged. A request with n > 1 sequences
  counts once in the request counters and histograms (vLLM counts each of its n children) and n times in the
  running / waiting gauges, which count sequences. vLLM's `vllm:time_per_output_token_seconds`
  (deprecated in vLLM 0.11, hidden since) is left out: `vllm:inter_token_latency_seconds` replaces it.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from elastic_hf.engine.sequence import Request

# Buckets sized for CPU serving of small models (ms..tens of s) and for GPUs (sub-ms TPOT).
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
# vLLM's own buckets (vllm/v1/metrics/loggers.py), so histogram_quantile over both servers compares like with like.
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0)
VLLM_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_LABELS = ("model_name", "engine")
VLLM_ENGINE = "0"
DEFAULT_MAX_MODEL_LEN = 8192   # bounds the token-count buckets when the engine's limit is not known


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_value."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class EngineMetrics:
    def __init__(self, model_id: str = "", registry: CollectorRegistry | None = None, *,
                 model_name: str | None = None, max_model_len: int | None = None):
        """model_name: the `model_name` label of the vLLM series (default: model_id); a server serving under
        another name sets it with `set_model_name` before its first request. max_model_len bounds vLLM's
        token-count buckets."""
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
        self.e2e = Histogram("elastic_hf_e2e_request_latency_seconds",
                             "Arrival to finish of a request (aborted and failed ones included)",
                             buckets=E2E_BUCKETS, registry=r)
        self.prefix_cache_queries = Counter("elastic_hf_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter("elastic_hf_prefix_cache_hits",
                                         "Prompt tokens the prefix cache held (not computed again)", registry=r)
        self.preemptions = Counter("elastic_hf_preemptions", "Requests preempted (recompute) for lack of KV blocks",
                                   registry=r)
        self.kv_blocks_used = Gauge("elastic_hf_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("elastic_hf_kv_blocks_total", "KV cache blocks attached", registry=r)
        self.num_waiting = Gauge("elastic_hf_num_requests_waiting", "Requests waiting for admission", registry=r)
        self.num_running = Gauge("elastic_hf_num_requests_running", "Requests in the running batch", registry=r)
        self.info = Gauge("elastic_hf_model_info", "Served model (value is always 1)", ["model_id"], registry=r)
        if model_id:
            self.info.labels(model_id=model_id).set(1)
        self._vllm_families = _vllm_families(r, max_model_len or DEFAULT_MAX_MODEL_LEN)
        self.vllm: dict[str, object] = {}   # family name -> its child for the current model_name
        self.model_name = ""
        self.set_model_name(model_name or model_id)
        # A deployment's engines share this object and set this to the deployment-wide (KV blocks used, attached,
        # waiting, running): whichever engine updates the gauges then publishes the deployment's numbers.
        self.load_totals: Callable[[], tuple[int, int, int, int]] | None = None

    def set_model_name(self, model_name: str) -> None:
        """Label the vLLM series with the served model name. Series recorded under a previous name are dropped, so
        call it before the first request (the server does so at startup)."""
        if model_name == self.model_name and self.vllm:
            return
        bound = bool(self.vllm)   # children of the previous name exist and go
        for name, family in self._vllm_families.items():
            if name == "request_success":   # every reason exported from the start, as vLLM does
                for reason in FINISH_REASONS:
                    if bound:
                        family.remove(self.model_name, VLLM_ENGINE, reason)
                self.vllm[name] = {reason: family.labels(model_name, VLLM_ENGINE, reason) for reason in FINISH_REASONS}
            else:
                if bound:
                    family.remove(self.model_name, VLLM_ENGINE)
                self.vllm[name] = family.labels(model_name, VLLM_ENGINE)
        self.model_name = model_name

    # ---- called by the engine (engine thread only) ----
    def on_request_arrived(self) -> None:
        self.requests_arrived.inc()

    def on_prompt_tokens(self, n: int) -> None:
        if n > 0:
            self.prompt_tokens.inc(n)

    def on_generation_tokens(self, n: int) -> None:
        if n > 0:
            self.generation_tokens.inc(n)
            self.vllm["generation_tokens"].inc(n)

    def observe_ttft(self, seconds: float, num_prompt_tokens: int = 0) -> None:
        """A request's first token; vLLM counts its prompt tokens as processed now (once, whatever recompute)."""
        self.ttft.observe(max(0.0, seconds))
        self.vllm["time_to_first_token_seconds"].observe(max(0.0, seconds))
        if num_prompt_tokens > 0:
            self.vllm["prompt_tokens"].inc(num_prompt_tokens)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(max(0.0, seconds))
        self.vllm["inter_token_latency_seconds"].observe(max(0.0, seconds))

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        """Prompt tokens looked up in the prefix cache at admission, and of them found computed."""
        if queried_tokens > 0:
            self.prefix_cache_queries.inc(queried_tokens)
            self.vllm["prefix_cache_queries"].inc(queried_tokens)
        if hit_tokens > 0:
            self.prefix_cache_hits.inc(hit_tokens)
            self.vllm["prefix_cache_hits"].inc(hit_tokens)

    def on_preemption(self, n: int = 1) -> None:
        if n > 0:
            self.preemptions.inc(n)
            self.vllm["num_preemptions"].inc(n)

    def set_load(self, kv_used: int, kv_total: int, num_waiting: int, num_running: int) -> None:
        """KV blocks and queue of the engine calling, or of the whole deployment when `load_totals` is set."""
        if self.load_totals is not None:
            kv_used, kv_total, num_waiting, num_running = self.load_totals()
        self.kv_blocks_used.set(kv_used)
        self.kv_blocks_total.set(kv_total)
        self.num_waiting.set(num_waiting)
        self.num_running.set(num_running)
        self.vllm["kv_cache_usage_perc"].set(kv_used / kv_total if kv_total else 0.0)   # a fraction, as in vLLM
        self.vllm["num_requests_waiting"].set(num_waiting)
        self.vllm["num_requests_running"].set(num_running)

    def on_request_finished(self, finish_reason: str | None, request: Request | None = None) -> None:
        """A request left the engine (finished, aborted or failed): its finish reason and, given the request,
        its latencies and sizes."""
        self.requests_finished.labels(finish_reason=finish_reason or "unknown").inc()
        counters = self.vllm["request_success"]
        if finish_reason in counters:
            counters[finish_reason].inc()
        if request is not None:
            self._observe_request(request)

    def _observe_request(self, request: Request) -> None:
        """vLLM's per-request histograms (FinishedRequestStats): phases end at first scheduling (queue), first
        token (prefill) and last token (decode); a phase never reached lasts 0."""
        finish = request.finish_time if request.finish_time is not None else time.time()
        arrival = request.arrival_time
        starts = [s.scheduled_time for s in request.seqs if s.scheduled_time is not None]
        scheduled = min(starts) if starts else finish
        first = request.first_token_time if request.first_token_time is not None else scheduled
        last = request.last_token_time if request.last_token_time is not None else first
        longest = max((s.num_output_tokens for s in request.seqs), default=0)
        e2e = max(0.0, finish - arrival)
        self.e2e.observe(e2e)
        v = self.vllm
        v["e2e_request_latency_seconds"].observe(e2e)
        v["request_queue_time_seconds"].observe(max(0.0, scheduled - arrival))
        v["request_prefill_time_seconds"].observe(max(0.0, first - scheduled))
        v["request_inference_time_seconds"].observe(max(0.0, last - scheduled))
        v["request_decode_time_seconds"].observe(max(0.0, last - first))
        v["request_time_per_output_token_seconds"].observe(max(0.0, last - first) / (longest - 1) if longest > 1
                                                           else 0.0)
        v["request_prompt_tokens"].observe(len(request.prompt_token_ids))
        v["request_generation_tokens"].observe(sum(s.num_output_tokens for s in request.seqs))
        v["request_params_max_tokens"].observe(request.params.max_tokens)
        v["request_params_n"].observe(request.params.n)

    # ---- read side ----
    def render(self) -> bytes:
        """Prometheus text exposition of this engine's registry."""
        return generate_latest(self.registry)


def _vllm_families(registry: CollectorRegistry, max_model_len: int) -> dict[str, object]:
    """vLLM's metric families by their name after `vllm:` (a Counter "vllm:x" exports "vllm:x_total")."""
    labels, r = list(VLLM_LABELS), registry
    tokens = build_1_2_5_buckets(max_model_len)

    def histogram(name, doc, buckets):
        return Histogram(f"vllm:{name}", doc, labels, buckets=buckets, registry=r)

    families = {
        "num_requests_running": Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                                      labels, registry=r),
        "num_requests_waiting": Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                                      labels, registry=r),
        "kv_cache_usage_perc": Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                     labels, registry=r),
        "num_preemptions": Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   labels, registry=r),
        "prompt_tokens": Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels, registry=r),
        "generation_tokens": Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                     registry=r),
        "request_success": Counter("vllm:request_success", "Count of successfully processed requests.",
                                   labels + ["finished_reason"], registry=r),
        "prefix_cache_queries": Counter("vllm:prefix_cache_queries",
                                        "Prefix cache queries, in terms of number of queried tokens.", labels,
                                        registry=r),
        "prefix_cache_hits": Counter("vllm:prefix_cache_hits",
                                     "Prefix cache hits, in terms of number of cached tokens.", labels, registry=r),
    }
    for name, doc, buckets in (
            ("time_to_first_token_seconds", "Histogram of time to first token in seconds.", VLLM_TTFT_BUCKETS),
            ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", VLLM_ITL_BUCKETS),
            ("request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
             VLLM_ITL_BUCKETS),
            ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
             VLLM_REQUEST_LATENCY_BUCKETS),
            ("request_prompt_tokens", "Number of prefill tokens processed.", tokens),
            ("request_generation_tokens", "Number of generation tokens processed.", tokens),
            ("request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens),
            ("request_params_n", "Histogram of the n request parameter.", VLLM_N_BUCKETS)):
        families[name] = histogram(name, doc, buckets)
    return families
