"""Torch-free request state. A request with n > 1 owns n sequences that share the prompt."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.units import ceil_div


def worst_case_kv_blocks(num_prompt_tokens: int, max_tokens: int, block_size: int, num_seqs: int) -> int:
    """KV blocks a request takes at most: each of its sequences holding the prompt and all `max_tokens` (what routing
    and queue rebalancing check an instance's room against)."""
    return ceil_div(num_prompt_tokens + max_tokens, block_size) * num_seqs


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    EXCHANGING = "exchanging"   # holds blocks whose KV a peer is still sending (KunServe §4.2): not scheduled
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int                       # 0..n-1 within its request
    token_ids: list[int]             # prompt followed by the generated tokens
    num_prompt_tokens: int
    params: SamplingParams
    arrival_time: float
    status: SeqStatus = SeqStatus.WAITING
    scheduled_time: float | None = None   # first admission to the running batch: its queue time ends here
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0     # tokens whose K/V are in the cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    text: str = ""                   # detokenized output, stop string removed
    decoded_text: str = ""           # detokenized output as decoded so far (before stop strings)
    num_decoded_tokens: int = 0      # output tokens already fed to the detokenizer
    decode_stream: object = None     # the detokenizer's incremental state (tokenizers.decoders.DecodeStream)
    num_emitted_chars: int = 0       # of `text`, already handed out as deltas
    num_emitted_tokens: int = 0
    sampler_state: object = None     # per-sequence logits processors and RNG, owned by the sampler
    grammar: object = None           # structured output: the constraint's state (engine/grammar.py GrammarState)
    logprobs: list = field(default_factory=list)   # TokenLogprob per output token, when params.logprobs is set
    # Prefix caching (kv/prefix_cache.py): the hashes of the sequence's full blocks so far (a chain begun in
    # `cache_epoch`; None: the sequence neither finds nor registers blocks), how many of its blocks the cache names
    # already, and how many prompt tokens its first admission found computed (usage.cached_tokens).
    block_hashes: list = field(default_factory=list)
    cache_epoch: int | None = None
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    prompt_logprobs: list | None = None   # TokenLogprob per prompt token (None first), when params.prompt_logprobs
    error: str | None = None              # why the engine failed this request alone

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def is_unstarted(self) -> bool:
        """Every sequence waits with no KV block: it can move to another instance for nothing."""
        return all(s.status is SeqStatus.WAITING and not s.block_ids for s in self.seqs)
