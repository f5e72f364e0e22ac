"""An LLMEngine-shaped facade over a Deployment, so that the server's AsyncEngine drives a multi-worker deployment
unchanged: one thread owns it, and transforms (`reshape`, the elastic TP policy) run on that thread between steps,
which is the quiesce point of the transaction. Use `await async_engine.call(engine.reshape, [2])` from an admin
route."""
from __future__ import annotations

from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.parallel.deployment import Deployment, ReshapeReport


class DeploymentEngine:
    def __init__(self, deployment: Deployment):
        self.deployment = deployment

    @property
    def model_id(self) -> str:
        return self.deployment.model_id

    @property
    def max_model_len(self) -> int:
        return self.deployment.max_model_len

    @property
    def tokenizer(self):
        return self.deployment.tokenizer

    @property
    def metrics(self):
        """One EngineMetrics shared by every instance engine; its registry also holds the deployment metrics."""
        return self.deployment.engine_metrics

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        self.deployment.add_request(prompt, params, request_id=request_id, arrival_time=arrival_time)

    def abort_request(self, request_id: str) -> None:
        self.deployment.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.deployment.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        return self.deployment.step()

    def stats(self) -> dict:
        stats = self.deployment.stats()
        instances = stats["instances"]
        for key in ("kv_blocks_used", "kv_blocks_total", "num_waiting", "num_running", "num_requests",
                    "num_steps"):
            stats[key] = sum(i[key] for i in instances)
        return stats

    def reshape(self, target, weights_source: str | None = None) -> ReshapeReport:
        return self.deployment.reshape(target, weights_source)

    def memory_report(self) -> list[dict]:
        return self.deployment.memory_report()
