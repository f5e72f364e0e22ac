"""Continuous-batching scheduler (torch-free).

Every step packs, under a token budget: one token for each running decode, the next chunk of each running
prefill, then new requests from the waiting queue (FCFS). When KV blocks run out, the most recently admitted
running sequence is preempted by recompute: its blocks are freed and it goes back to the front of the queue with
its generated tokens appended to its prompt, so no output is lost.

A step is three calls (engine/llm_engine.py): `schedule()` returns a typed SchedulerOutput, the executor runs it and
returns a ModelRunnerOutput, and `update_from_output` advances every sequence it touched (computed tokens, sampled
tokens, their log-probabilities). The blocks come from the instance's KVManager (kv/kv_manager.py), the only owner
of KV capacity."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from elastic_hf.config import EngineConfig
from elastic_hf.engine.sequence import Sequence, SeqStatus
from elastic_hf.engine.step_plan import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
from elastic_hf.kv.kv_manager import KVManager

__all__ = ["ScheduledSeq", "Scheduler", "SchedulerOutput"]


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVManager, num_stages: int = 1):
        """Reads max_num_seqs, max_num_batched_tokens and block_size of the config. A pipeline of `num_stages`
        stages schedules that many times more per step: the step is split into one micro-batch per stage, each as
        large as a data-parallel instance's step (a drop group serves the union of its members' batches)."""
        self.max_num_seqs = config.max_num_seqs * num_stages
        self.max_num_batched_tokens = config.max_num_batched_tokens * num_stages
        self.block_size = config.block_size
        if kv.block_size != self.block_size:
            raise ValueError(f"the KV manager's blocks hold {kv.block_size} tokens, the config's {self.block_size}")
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # KV in transit (a parameter drop's exchange, KunServe §4.2): these hold their blocks but wait, while the
        # queue keeps running on the free blocks. Blocks of one aborted meanwhile are held (KVManager.hold) until
        # the exchange ends: the exchange still writes into them.
        self.exchanging: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.exchanging)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks `seq` must still get for its next `num_new_tokens` tokens."""
        return self.kv.blocks_to_grow(len(seq.block_ids), seq.num_computed_tokens + num_new_tokens)

    def head_of_line(self) -> tuple[Sequence | None, bool]:
        """The oldest waiting sequence and whether it is blocked on KV blocks (its next chunk's blocks are not
        free), as the morph monitor sees the queue."""
        if not self.waiting:
            return None, False
        head = self.waiting[0]
        chunk = min(head.num_uncomputed_tokens, self.max_num_batched_tokens)
        return head, not self.kv.can_allocate(self.blocks_needed(head, chunk))

    def preempt(self, seq: Sequence) -> None:
        """Preempt a running sequence by recompute: free its blocks and put it first in the queue (its generated
        tokens stay; they are prefilled again with the prompt)."""
        self.running.remove(seq)
        self.kv.free(seq.block_ids)
        self.reset_for_recompute(seq)
        self.waiting.appendleft(seq)

    def reset_for_recompute(self, seq: Sequence) -> None:
        """A sequence whose KV cache is gone (freed here, or left behind by a reshape) waits to be prefilled
        again with its generated tokens; counted as a preemption."""
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []

        # Running sequences first, oldest first: they already hold blocks and their users wait on tokens.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self.blocks_needed(seq, num_new)
            while not self.kv.can_allocate(needed):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                break  # seq preempted itself: nothing younger is left to run
            seq.block_ids.extend(self.kv.allocate(needed))
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1

        # Admit waiting sequences while the budget, the sequence cap and the free blocks allow. Never preempt for
        # a newcomer.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self.blocks_needed(seq, num_new)
            if not self.kv.can_allocate(needed):
                break
            self.waiting.popleft()
            seq.block_ids.extend(self.kv.allocate(needed))
            seq.status = SeqStatus.RUNNING
            if seq.scheduled_time is None:   # the first admission only: a recompute does not queue anew
                seq.scheduled_time = time.time()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled)

    def update_from_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> int:
        """Advance every sequence of the step: its scheduled tokens are in the cache now, and each sampling row's
        token (with its log-probability record, when asked) joins its sequence, unless that row failed or the
        sequence ended meanwhile. Whether a sequence is done (EOS, stop strings, length) is the output processor's
        call. Returns how many prompt tokens the step computed (recompute after preemption included)."""
        num_prompt_tokens = 0
        for s in scheduler_output.scheduled:
            seq = s.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                num_prompt_tokens += min(s.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens)
            seq.num_computed_tokens += s.num_new_tokens
        logprobs = runner_output.logprobs
        for row, (seq, token) in enumerate(zip(scheduler_output.sampling_seqs, runner_output.sampled_token_ids)):
            if token is None or seq.is_finished:
                continue
            if logprobs is not None and logprobs[row] is not None:
                seq.logprobs.append(logprobs[row])
            seq.token_ids.append(token)
        return num_prompt_tokens

    def adopt(self, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> None:
        """Take over sequences that another scheduler ran (a reshape moves requests between instances). Both
        queues stay in admission order (sequence ids grow with admission): older sequences run first and
        preemption still hits the youngest. Their blocks must already be this scheduler's."""
        self.running[:] = sorted([*self.running, *running], key=lambda s: s.seq_id)
        merged = sorted([*self.waiting, *waiting], key=lambda s: s.seq_id)
        self.waiting.clear()
        self.waiting.extend(merged)

    def park_exchanging(self, seqs: Iterable[Sequence]) -> None:
        """Running sequences whose blocks (already this scheduler's) are still being filled by a KV exchange."""
        for seq in seqs:
            seq.status = SeqStatus.EXCHANGING
            self.exchanging.append(seq)

    def release_exchanging(self) -> int:
        """The exchange is over: the parked sequences run again in admission order, held blocks go back. Returns
        how many resumed."""
        resumed = list(self.exchanging)
        for seq in resumed:
            seq.status = SeqStatus.RUNNING
        self.exchanging.clear()
        self.adopt(resumed, [])
        self.kv.release_held()
        return len(resumed)

    def drop_exchanging(self) -> int:
        """The exchange was lost (a group member died): the parked sequences are recomputed. Returns how many."""
        parked = list(self.exchanging)
        self.exchanging.clear()
        for seq in parked:
            self.kv.free(seq.block_ids)
            self.reset_for_recompute(seq)
        self.waiting.extendleft(reversed(sorted(parked, key=lambda s: s.seq_id)))
        self.kv.release_held()
        return len(parked)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Release the sequence's blocks at once (finish, stop or cancel)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.EXCHANGING:
            self.exchanging.remove(seq)
            self.kv.hold(seq.block_ids)
            seq.block_ids = []
        if seq.block_ids:
            self.kv.free(seq.block_ids)
            seq.block_ids = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
