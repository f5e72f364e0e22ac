"""The engine interface that drivers depend on (AsyncEngine, ElasticModel's offline calls): one instance's
LLMEngine and a multi-instance Deployment both implement it, so the server drives either unchanged."""
from __future__ import annotations

from typing import Any, Protocol

from elastic_hf.engine.input_processor import EngineRequest, InputProcessor
from elastic_hf.engine.metrics import EngineMetrics
from elastic_hf.engine.outputs import RequestOutput
from elastic_hf.engine.sampling_params import SamplingParams


class EngineCore(Protocol):
    model_id: str
    max_model_len: int
    tokenizer: Any
    metrics: EngineMetrics
    input_processor: InputProcessor   # validates and tokenizes (any thread): EngineRequests for add_request
    num_steps: int          # steps that ran a forward pass; unchanged by a step() that scheduled nothing

    def add_request(self, request_id: str, prompt: str | list[int] | EngineRequest,
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        """Raises InvalidRequest (a ValueError) for bad input; nothing else changes then. An EngineRequest carries
        its params and arrival time."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Idempotent: a no-op for unknown or finished requests."""
        ...

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or work that needs step boundaries without requests (a precision swap)."""
        ...

    def step(self) -> list[RequestOutput]:
        ...

    def stats(self) -> dict:
        ...
