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
from elastic_hf.kv.prefix_cache import extend_block_hashes

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
        # Sequences whose step is in flight (engine/batch_queue.py: a pipeline keeps several batches going), with
        # their tokens in those batches: never preempted, and scheduled again only with the next chunk of a prompt
        # whose chunks in flight do not sample (continues_in_flight).
        self.in_flight: dict[int, int] = {}
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.exchanging)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, start: int | None = None) -> int:
        """Blocks `seq` must still get for `num_new_tokens` tokens from `start` (default: its computed tokens)."""
        start = seq.num_computed_tokens if start is None else start
        return self.kv.blocks_to_grow(len(seq.block_ids), start + num_new_tokens)

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
        self._forget_computed(seq)
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1

    @staticmethod
    def _forget_computed(seq: Sequence) -> None:
        seq.block_ids = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ prefix caching (kv/prefix_cache.py)
    def _take_cached_prefix(self, seq: Sequence) -> int:
        """Hold the cached blocks of the longest computed prefix of `seq` (never its last token, whose logits the
        step needs; nothing for a request that asks for prompt log-probabilities, which need every position's
        logits) and count those tokens computed. Returns how many tokens that is."""
        epoch = self.kv.cache_epoch
        if seq.cache_epoch != epoch:   # admitted in this epoch of this instance's cache: it may register blocks
            seq.cache_epoch, seq.num_registered_blocks = epoch, 0
        if epoch is None or seq.params.prompt_logprobs is not None:
            return 0
        num_blocks = (len(seq.token_ids) - 1) // self.block_size
        hit = self.kv.lookup_prefix(self._block_hashes(seq, num_blocks)[:num_blocks])
        if not hit:
            return 0
        self.kv.take_cached(hit)
        seq.block_ids = list(hit)
        seq.num_computed_tokens = len(hit) * self.block_size
        seq.num_registered_blocks = len(hit)
        return seq.num_computed_tokens

    def _sibling_prefills(self, seq: Sequence) -> bool:
        """A running sibling of `seq` (a sequence of the same request, n > 1: the same prompt by construction) is
        still computing that prompt, which holds at least one full block `seq` would otherwise compute again."""
        if self.kv.prefix_cache is None or seq.params.n < 2 or seq.num_prompt_tokens <= self.block_size:
            return False
        return any(s.request_id == seq.request_id and s.num_computed_tokens < seq.num_prompt_tokens
                   for s in self.running)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list:
        """The hashes of the first `num_blocks` full blocks of `seq` (its chain, extended as far as needed)."""
        return extend_block_hashes(seq.block_hashes, seq.token_ids, self.block_size, num_blocks,
                                   self.kv.prefix_cache.hash, seq.params.cache_salt)

    def _register_full_blocks(self, seq: Sequence) -> None:
        """Name the blocks `seq` has just filled, so later prompts with the same prefix find them."""
        if seq.cache_epoch is None or seq.cache_epoch != self.kv.cache_epoch:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        if full <= seq.num_registered_blocks:
            return
        hashes = self._block_hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.kv.cache_block(seq.block_ids[i], hashes[i])
        seq.num_registered_blocks = full

    def send(self, scheduler_output: SchedulerOutput) -> None:
        """The batch's step is in flight (sent to a pipeline whose output comes later)."""
        for s in scheduler_output.scheduled:
            self.in_flight[s.seq.seq_id] = self.in_flight.get(s.seq.seq_id, 0) + s.num_new_tokens

    def land(self, scheduler_output: SchedulerOutput) -> None:
        """The batch's step is no longer in flight: its output is in, or it was discarded."""
        for s in scheduler_output.scheduled:
            left = self.in_flight.get(s.seq.seq_id, 0) - s.num_new_tokens
            if left > 0:
                self.in_flight[s.seq.seq_id] = left
            else:
                self.in_flight.pop(s.seq.seq_id, None)

    def continues_in_flight(self, seq: Sequence) -> int | None:
        """Where the next chunk of an in-flight `seq` would start, if it may run in the batch behind: its chunks in
        flight do not reach its last token (none samples, so the next chunk needs no token from them) and no
        prompt log-probabilities are recorded for it (those are taken in chunk order from the computed count).
        Every stage runs the batches in order, so that chunk attends to KV its predecessors wrote. None: wait."""
        start = seq.num_computed_tokens + self.in_flight[seq.seq_id]
        if start >= len(seq.token_ids) or seq.params.prompt_logprobs is not None:
            return None
        return start

    def num_runnable(self) -> int:
        """Sequences a step could take now: running ones not in flight, and the queue."""
        return len(self.running) - sum(s.seq_id in self.in_flight for s in self.running) + len(self.waiting)

    def _youngest_preemptible(self) -> Sequence:
        """The youngest running sequence not in flight (the one being scheduled is one, so there always is one)."""
        return next(seq for seq in reversed(self.running) if seq.seq_id not in self.in_flight)

    def schedule(self, max_seqs: int | None = None, budget: int | None = None) -> SchedulerOutput:
        """One step's work. max_seqs / budget: caps of this batch below the scheduler's own (a pipeline with
        several batches in flight splits its running sequences and token budget between them)."""
        budget = self.max_num_batched_tokens if budget is None else min(budget, self.max_num_batched_tokens)
        max_seqs = self.max_num_seqs if max_seqs is None else max_seqs
        scheduled: list[ScheduledSeq] = []
        queries = hits = 0

        # Running sequences first, oldest first: they already hold blocks and their users wait on tokens.
        i = 0
        while i < len(self.running) and budget > 0 and len(scheduled) < max_seqs:
            seq = self.running[i]
            i += 1
            if seq.seq_id in self.in_flight:
                start = self.continues_in_flight(seq)
                if start is None:
                    continue
                num_new = min(len(seq.token_ids) - start, budget)
                needed = self.blocks_needed(seq, num_new, start)
                if not self.kv.can_allocate(needed):
                    continue   # a chunk ahead of its predecessor's output never preempts anything
            else:
                start, num_new = seq.num_computed_tokens, min(seq.num_uncomputed_tokens, budget)
                needed = self.blocks_needed(seq, num_new)
                while not self.kv.can_allocate(needed):
                    victim = self._youngest_preemptible()
                    self.preempt(victim)
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    break  # seq preempted itself: nothing younger outside the batches in flight is left to run
            seq.block_ids.extend(self.kv.allocate(needed))
            scheduled.append(ScheduledSeq(seq, num_new, start))
            budget -= num_new

        # Admit waiting sequences while the budget, the sequence cap and the free blocks allow. Never preempt for
        # a newcomer. A sequence with nothing computed (new, or preempted) first takes the cached blocks of its
        # longest computed prefix and skips those tokens.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and len(scheduled) < max_seqs:
            seq = self.waiting[0]
            fresh = not seq.block_ids and not seq.num_computed_tokens
            if fresh and self._sibling_prefills(seq):
                break   # n > 1: it waits for the sibling's prompt blocks and then finds them cached (FCFS holds)
            cached = self._take_cached_prefix(seq) if fresh else 0
            num_new = min(seq.num_uncomputed_tokens, budget)
            needed = self.blocks_needed(seq, num_new)
            if not self.kv.can_allocate(needed):
                if cached:   # give the prefix back (it stays cached) and wait, as without a cache
                    self.kv.free(seq.block_ids)
                    self._forget_computed(seq)
                break
            self.waiting.popleft()
            seq.block_ids.extend(self.kv.allocate(needed))
            seq.status = SeqStatus.RUNNING
            if seq.scheduled_time is None:   # the first admission only: a recompute does not queue anew
                seq.scheduled_time = time.time()
                seq.num_cached_tokens = cached
            if fresh and self.kv.prefix_cache is not None and seq.params.prompt_logprobs is None:
                queries += len(seq.token_ids)
                hits += cached
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed_tokens))
            budget -= num_new
        if queries:
            self.kv.prefix_cache.count_lookups(queries, hits)
        return SchedulerOutput(scheduled, queries, hits)

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
        if self.kv.prefix_cache is not None:
            for s in scheduler_output.scheduled:
                self._register_full_blocks(s.seq)
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

    def remove_waiting(self, seqs: Iterable[Sequence]) -> None:
        """Take waiting sequences out of the queue (their request moves to another instance)."""
        leaving = {seq.seq_id for seq in seqs}
        kept = [seq for seq in self.waiting if seq.seq_id not in leaving]
        self.waiting.clear()
        self.waiting.extend(kept)

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
