"""Per-request sampling parameters, validated at construction so bad input fails before it reaches the engine."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from elastic_hf.engine.errors import InvalidRequest
from elastic_hf.engine.structured_outputs import StructuredOutputsParams
from elastic_hf.model.generation_defaults import SAMPLING_FIELDS, GenerationDefaults

# Most alternatives per token a request may ask for (vLLM's default --max-logprobs, OpenAI's top_logprobs limit):
# every one is a top-k over the vocabulary at every step.
MAX_LOGPROBS = 20
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-200 overflows to inf and the
# sampler would see NaN probabilities.
GREEDY_TEMPERATURE = 1e-5
# A repetition penalty divides positive logits: below this it overflows them to inf (found by fuzzing: 2.2e-308)
MIN_REPETITION_PENALTY = 1e-4
# OpenAI's ranges of the additive penalties and of logit_bias values
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names). CUMULATIVE copies the whole output so far on
    every step, which grows with the output's length; a server streams DELTA and answers non-streaming requests
    with FINAL_ONLY, so its per-step work does not."""
    CUMULATIVE = "cumulative"   # every output: text / token_ids / logprobs so far, plus the delta_* fields
    DELTA = "delta"             # every output: only what is new (text / token_ids / logprobs are the delta_* ones)
    FINAL_ONLY = "final_only"   # one output, when the request finishes, with everything


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0          # 0 means greedy
    top_p: float = 1.0                # in (0, 1]
    top_k: int = 0                    # 0 disables
    repetition_penalty: float = 1.0   # 1 disables; > 0; divides the logits of prompt and output tokens (HF's)
    presence_penalty: float = 0.0     # OpenAI's: subtracted from the logit of every token the output holds
    frequency_penalty: float = 0.0    # OpenAI's: subtracted once per occurrence in the output
    min_p: float = 0.0                # keep tokens with probability >= min_p x the top one's (sampling only)
    min_tokens: int = 0               # no EOS, stop token or stop string before this many output tokens
    logit_bias: dict[int, float] | None = None      # token id -> added to its logit, in [-100, 100]
    bad_words: list[str] = field(default_factory=list)     # words never generated (with or without a leading space)
    allowed_token_ids: list[int] | None = None      # only these tokens may be generated
    structured_outputs: StructuredOutputsParams | None = None   # the output must match this (engine/grammar.py)
    seed: int | None = None           # same seed, same prompt, same params -> same output
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None        # None: none; k >= 0: each output token's log-probability and the top k
    prompt_logprobs: int | None = None   # the same for every prompt token (OpenAI's echo with logprobs)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Not a sampling knob but a property of the request that travels with it (vLLM's cache_salt): prompt KV is
    # shared through the prefix cache only between requests of the same salt (kv/prefix_cache.py).
    cache_salt: str | None = None
    # stop_token_ids as a set: every sampled token of every step is looked up in it (a list scan costs ~1 ms at
    # 150k ids); derived, not an argument
    stop_token_set: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    # bad_words as token sequences: the input processor tokenizes them (it owns the tokenizer)
    bad_words_token_ids: list = field(default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words or [])
        for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequest(f"{name} must be a finite number, got {value!r}", param=name)
        if 0 < self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", param="max_tokens")
        if self.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0 (0 = greedy), got {self.temperature}",
                                 param="temperature")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequest(f"top_k must be an integer >= 0 (0 disables), got {self.top_k!r}", param="top_k")
        if self.repetition_penalty < MIN_REPETITION_PENALTY:
            raise InvalidRequest(f"repetition_penalty must be >= {MIN_REPETITION_PENALTY:g} (1 disables), got "
                                 f"{self.repetition_penalty}", param="repetition_penalty")
        self._check_processor_fields()
        if not isinstance(self.n, int) or self.n < 1:
            raise InvalidRequest(f"n must be an integer >= 1, got {self.n!r}", param="n")
        if self.seed is not None and not isinstance(self.seed, int):
            raise InvalidRequest(f"seed must be an integer, got {self.seed!r}", param="seed")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop strings must be non-empty", param="stop")
        if any((not isinstance(t, int)) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids[:8]}",
                                 param="stop_token_ids")
        self.stop_token_set = frozenset(self.stop_token_ids)

        if not isinstance(self.output_kind, RequestOutputKind):
            raise InvalidRequest(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}",
                                 param="output_kind")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}", param=name)

    def _check_processor_fields(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not PENALTY_RANGE[0] <= getattr(self, name) <= PENALTY_RANGE[1]:
                raise InvalidRequest(f"{name} must be in [{PENALTY_RANGE[0]:g}, {PENALTY_RANGE[1]:g}], got "
                                     f"{getattr(self, name)}", param=name)
        if not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got "
                                 f"{self.min_tokens!r}", param="min_tokens")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise InvalidRequest("logit_bias must map token ids to numbers", param="logit_bias")
            bias = {}
            for token, value in self.logit_bias.items():
                try:
                    token_id = int(token)   # JSON object keys are strings
                except (TypeError, ValueError):
                    raise InvalidRequest(f"logit_bias keys must be token ids, got {token!r}",
                                         param="logit_bias") from None
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not \
                        LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
                    raise InvalidRequest(f"logit_bias values must be numbers in [{LOGIT_BIAS_RANGE[0]:g}, "
                                         f"{LOGIT_BIAS_RANGE[1]:g}], got {value!r} for token {token}",
                                         param="logit_bias")
                bias[token_id] = float(value)
            self.logit_bias = bias or None
        if any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise InvalidRequest("bad_words must be non-empty strings", param="bad_words")
        if self.allowed_token_ids is not None and (not self.allowed_token_ids or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.allowed_token_ids)):
            raise InvalidRequest("allowed_token_ids must be a non-empty list of non-negative token ids",
                                 param="allowed_token_ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs must be a StructuredOutputsParams", param="structured_outputs")

    def token_ids_to_check(self) -> dict[str, list[int]]:
        """The token ids a request names, by field, for the input processor's vocabulary check."""
        return {"stop_token_ids": self.stop_token_ids, "logit_bias": list(self.logit_bias or ()),
                "allowed_token_ids": list(self.allowed_token_ids or ())}

    @property
    def output_cost(self) -> int:
        """Tokens the request may make the engine produce and report: n x max_tokens x (1 + logprobs each)."""
        return self.n * self.max_tokens * (1 + (self.logprobs or 0))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


# transformers GenerationConfig field -> SamplingParams field: generation_config.json's, and per call also these
_GENERATION_FIELDS = {**SAMPLING_FIELDS, "num_return_sequences": "n", "stop_strings": "stop"}
# fields a GenerationConfig carries that say nothing about sampling (or that the engine reads elsewhere: EOS)
_GENERATION_IGNORED = {"do_sample", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version",
                       "_from_model_config", "use_cache", "output_attentions", "output_hidden_states",
                       "return_dict_in_generate", "output_scores", "output_logits"}


def sampling_params_from_generation_config(generation_config) -> SamplingParams:
    """A transformers GenerationConfig as SamplingParams, as HF generate reads it: greedy unless do_sample, the
    fields set on it (those differing from GenerationConfig's defaults) mapped; a field the engine does not
    implement (beam search, min_length, ...) is a ValueError naming it rather than silently ignored."""
    if not hasattr(generation_config, "to_diff_dict"):
        raise TypeError(f"sampling_params must be a SamplingParams or a transformers GenerationConfig, got "
                        f"{type(generation_config).__name__}")
    diff = generation_config.to_diff_dict()
    unsupported = sorted(k for k, v in diff.items()
                         if k not in _GENERATION_FIELDS and k not in _GENERATION_IGNORED and v is not None)
    if unsupported:
        raise ValueError(f"GenerationConfig fields {unsupported} are not supported; supported: "
                         f"{sorted(_GENERATION_FIELDS)} and do_sample")
    values = {ours: diff[theirs] for theirs, ours in _GENERATION_FIELDS.items() if diff.get(theirs) is not None}
    return SamplingParams(**GenerationDefaults(values, bool(diff.get("do_sample", False))).offline())
