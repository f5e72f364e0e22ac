"""Limits of a deployment a request meets at the door (torch-free): the queue is capped, so an overload is refused
(EngineOverloaded: HTTP 503 with Retry-After) instead of growing without bound; and the max_model_len a deployment
serves. What a request must satisfy on its own (prompt, stop strings) is checked once by the InputProcessor."""
from __future__ import annotations

from elastic_hf.config import EngineConfig
from elastic_hf.engine.errors import EngineOverloaded
from elastic_hf.engine.sampling_params import SamplingParams


def check_queue_capacity(config: EngineConfig, params: SamplingParams, num_queued: int) -> None:
    """Raises EngineOverloaded; num_queued: sequences waiting in every scheduler now."""
    if num_queued + params.n > config.max_queued_requests:
        raise EngineOverloaded(f"{num_queued} sequences are queued and max_queued_requests is "
                               f"{config.max_queued_requests}; retry later")


def resolve_max_model_len(config: EngineConfig, model_limit: int, kv_tokens: int, default_cap: int) -> int:
    """The configured max_model_len, else what the model (`model_limit` positions) and the largest KV cache a
    reshape can reach (`kv_tokens`) allow, at most `default_cap`. Raises ValueError for a configured value the
    model or the KV cache cannot hold."""
    requested = config.max_model_len
    if requested is None:
        return min(model_limit, kv_tokens, default_cap)
    if requested > model_limit:
        raise ValueError(f"max_model_len must be in [1, {model_limit}] for this model, got {requested}")
    if requested > kv_tokens:
        raise ValueError(f"max_model_len={requested} tokens does not fit the KV cache: the largest instance holds "
                         f"{kv_tokens // config.block_size} blocks x {config.block_size} tokens = {kv_tokens} tokens; "
                         f"raise kv_cache_memory / memory_budget or lower max_model_len")
    return requested
