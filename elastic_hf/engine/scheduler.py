"""Continuous-batching scheduler (torch-free).

Every step packs, under a token budget: one token for each running decode, the next chunk of each running
prefill, then new requests from the waiting queue (FCFS). When KV blocks run out, the most recently admitted
running sequence is preempted by recompute: its blocks are freed and it goes back to the front of the queue with
its generated tokens appended to its prompt, so no output is lost."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from elastic_hf.engine.sequence import Sequence, SeqStatus
from elastic_hf.kv.block_allocator import BlockAllocator


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def completes_prompt(self) -> bool:
        """True when after this step every token of the sequence is in the cache, so it samples."""
        return self.seq.num_computed_tokens + self.num_new_tokens == len(self.seq.token_ids)


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator):
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.config.block_size)
        return max(0, total - len(seq.block_ids))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_ids)
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []

        # Running sequences first, oldest first: they already hold blocks and their users wait on tokens.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self._blocks_needed(seq, num_new)
            while not self.allocator.can_allocate(needed):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq preempted itself: nothing younger is left to run
            seq.block_ids.extend(self.allocator.allocate(needed))
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1

        # Admit waiting sequences while the budget, the sequence cap and the free blocks allow. Never preempt for
        # a newcomer.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self._blocks_needed(seq, num_new)
            if not self.allocator.can_allocate(needed):
                break
            self.waiting.popleft()
            seq.block_ids.extend(self.allocator.allocate(needed))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release the sequence's blocks at once (finish, stop or cancel)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        if seq.block_ids:
            self.allocator.free(seq.block_ids)
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
