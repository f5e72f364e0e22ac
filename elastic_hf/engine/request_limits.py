"""Limits a request must respect before it is queued (torch-free): stop strings are matched at every step of their
request, so their number and length are capped (a 400 naming `stop`); the queue is capped, so an overload is
refused at the door (EngineOverloaded: HTTP 503 with Retry-After) instead of growing without bound."""
from __future__ import annotations

from elastic_hf.config import EngineConfig
from elastic_hf.engine.errors import EngineOverloaded, InvalidRequest
from elastic_hf.engine.sampling_params import SamplingParams


def check_request_limits(config: EngineConfig, params: SamplingParams, num_queued: int) -> None:
    """Raises InvalidRequest or EngineOverloaded; num_queued: sequences waiting in every scheduler now."""
    if len(params.stop) > config.max_stop_strings:
        raise InvalidRequest(f"at most {config.max_stop_strings} stop strings are allowed, got {len(params.stop)}",
                             param="stop")
    longest = max((len(s) for s in params.stop), default=0)
    if longest > config.max_stop_string_chars:
        raise InvalidRequest(f"stop strings may have at most {config.max_stop_string_chars} characters, got one "
                             f"of {longest}", param="stop")
    if num_queued + params.n > config.max_queued_requests:
        raise EngineOverloaded(f"{num_queued} sequences are queued and max_queued_requests is "
                               f"{config.max_queued_requests}; retry later")
