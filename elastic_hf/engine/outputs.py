"""What the engine hands back per request: the text/tokens (cumulative, or only the new ones: see
SamplingParams.output_kind) plus the delta since the previous output, and the log-probabilities a request asked
for."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    """The log-probability of one token under the model's raw output distribution (before temperature, top-k/p and
    penalties: vLLM's default `raw_logprobs` mode), its rank there (1 = most likely) and the `top` most likely
    tokens as (token_id, logprob), best first."""
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    index: int                              # 0..n-1 within the request
    text: str = ""                          # cumulative (DELTA kind: the delta), stop string removed
    token_ids: list[int] = field(default_factory=list)   # cumulative (DELTA kind: the delta)
    delta_text: str = ""                    # new since the previous RequestOutput
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None        # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[TokenLogprob] | None = None        # one per token in token_ids, when asked for
    delta_logprobs: list[TokenLogprob] | None = None  # one per token in delta_token_ids, when asked for


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    # One per prompt token when asked for: None for the first (nothing predicts it), then how likely the model found
    # each prompt token given the ones before it.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None                # set when the engine failed this request alone (finish_reason "error")
    num_cached_tokens: int = 0              # prompt tokens the prefix cache held at admission (vLLM's name)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
