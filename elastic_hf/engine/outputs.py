"""What the engine hands back per request: cumulative text/tokens plus the delta since the previous output."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int                              # 0..n-1 within the request
    text: str = ""                          # cumulative, stop string removed
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""                    # new since the previous RequestOutput
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None        # "stop" | "length" | "abort" | None while running


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
