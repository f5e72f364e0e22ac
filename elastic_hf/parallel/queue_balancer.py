"""Queue rebalancing executed between steps: reads every instance's queue, asks the policy (engine/rebalance.py)
which unstarted requests to move, and moves them (LLMEngine.release_unstarted -> adopt). Bookkeeping only: a
waiting request holds no KV block, so no worker is involved."""
from __future__ import annotations

import logging
from collections.abc import Callable

from elastic_hf.config import EngineConfig
from elastic_hf.engine.rebalance import InstanceQueue, QueuedRequest, imbalanced, plan_moves
from elastic_hf.engine.sequence import SeqStatus, worst_case_kv_blocks

log = logging.getLogger(__name__)


class QueueBalancer:
    def __init__(self, config: EngineConfig, lookup_hashes: Callable):
        """config: rebalance_queues (read at every step: it may be switched), the step budget and block size, and
        whether a prefix cache gives requests an affinity; lookup_hashes(request): its prefix-cache lookup hashes."""
        self.config = config
        self.lookup_hashes = lookup_hashes if config.enable_prefix_caching else None
        self.pinned: set[str] = set()          # add_request(instance=...): they stay where they were sent
        self.num_moved = 0
        self._hashes: dict[str, list | None] = {}   # of the requests read so far (a prompt is hashed once)

    def on_step(self, instances, fixed: set[str]) -> int:
        """Make this step boundary's moves; `fixed`: other requests that stay (long ones on a merged instance).
        Returns how many moved."""
        if not self.config.rebalance_queues or len(instances) < 2 \
                or not any(i.engine.scheduler.waiting for i in instances):
            return 0
        live = {r for inst in instances for r in inst.engine.requests}
        self.pinned &= live
        self._hashes = {r: h for r, h in self._hashes.items() if r in live}
        queues, waiting = instance_queues(instances, self.config.max_num_batched_tokens, self.config.block_size,
                                          self.pinned | fixed)
        if not imbalanced(queues, waiting):
            return 0
        if self.lookup_hashes is not None:
            self._weigh_cached_prefixes(instances, waiting)
        moves = plan_moves(queues, waiting)
        for move in moves:
            request = instances[move.source].engine.release_unstarted(move.request_id)
            instances[move.target].engine.adopt(request, {})
            log.debug("request %s moved from instance %d to %d (prefill done %.1f steps sooner)", move.request_id,
                      move.source, move.target, move.gain_steps)
        self.num_moved += len(moves)
        return len(moves)

    def _weigh_cached_prefixes(self, instances, waiting: list[QueuedRequest]) -> None:
        """Each movable request's cached prompt tokens on every instance (a move would leave its prefix behind)."""
        for queued in waiting:
            if not queued.movable:
                continue
            if queued.request_id not in self._hashes:
                request = instances[queued.instance].engine.requests[queued.request_id]
                self._hashes[queued.request_id] = self.lookup_hashes(request)
            hashes = self._hashes[queued.request_id]
            if hashes:
                queued.cached_tokens = {i: len(inst.engine.scheduler.kv.lookup_prefix(hashes)) * self.config.block_size
                                        for i, inst in enumerate(instances)}


def instance_queues(instances, budget: int, block_size: int, fixed: set[str]
                    ) -> tuple[list[InstanceQueue], list[QueuedRequest]]:
    """What queue rebalancing reads (engine/rebalance.py): each instance's step budget, decoding rows, prompt tokens
    left of its running sequences and free KV, and every waiting request. A request moves only when nothing of it
    has started and it is not in `fixed` (pinned by the caller, or long: it went to a merged instance on purpose)."""
    queues, waiting = [], []
    for idx, inst in enumerate(instances):
        scheduler = inst.engine.scheduler
        kv = scheduler.kv
        left = [seq.num_uncomputed_tokens for seq in scheduler.running]
        queues.append(InstanceQueue(idx, len(inst.workers), budget, sum(n <= 1 for n in left),
                                    sum(n for n in left if n > 1), kv.num_free, kv.num_total))
        seen: set[str] = set()
        for seq in scheduler.waiting:
            if seq.request_id in seen:
                continue
            seen.add(seq.request_id)
            request = inst.engine.requests[seq.request_id]
            seqs = request.seqs
            tokens = sum(s.num_uncomputed_tokens for s in seqs if s.status is SeqStatus.WAITING)
            blocks = worst_case_kv_blocks(len(request.prompt_token_ids), request.params.max_tokens, block_size,
                                          len(seqs))
            movable = request.request_id not in fixed and request.is_unstarted
            waiting.append(QueuedRequest(request.request_id, idx, min(s.seq_id for s in seqs), tokens, blocks,
                                         movable))
    return queues, waiting
