"""What a reshape transaction does, as data (torch-free): built by the control plane from its schedulers, sent to
every worker, executed there up to the commit point."""
from __future__ import annotations

from dataclasses import dataclass, field

from elastic_hf.topology import Topology
from elastic_hf.kv.exchange_schedule import exchange_peak_bytes, exchange_schedule
from elastic_hf.kv.migration_plan import BlockMove, KVTransfer
from elastic_hf.kv.layout import block_pages


WEIGHT_SOURCES = ("host", "peers")


@dataclass(slots=True)
class ReshapePlan:
    old: Topology
    new: Topology
    moves: list[BlockMove]
    transfers: list[KVTransfer]
    live_old_blocks: dict[int, list[int]]      # old instance -> its live block ids (kept until commit)
    num_live_new_blocks: dict[int, int]        # new instance -> live blocks after migration (ids 0..n-1)
    new_num_blocks: dict[int, int]             # new instance -> KV capacity in blocks after commit
    seq_moves: dict[int, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (old instance, new instance)
    kept: dict[int, int] = field(default_factory=dict)  # new instance -> old instance with the same workers
    weights_source: str = "host"               # where missing shard chunks come from: "host" store or "peers"
    overlap_weights: bool = True               # load host-store chunks while the KV migrates (ReMP §3.3)
    # A parameter drop (KunServe §4.2): the KV moves after the commit point, beside the steps, while the
    # new instance already serves queued requests (parallel/kv_exchange.py); the old pools live until then.
    defer_kv: bool = False
    # The deferred exchange's chunks (kv/exchange_schedule.py): one where both pools fit a member's budget at once
    # (fewest rounds beside the steps), EXCHANGE_CHUNKS where they do not (plan_reshape decides).
    exchange_chunks: int = 1
    # A restore whose full KV blocks were copied beside the steps (restore_precopy.py): `transfers` move only the
    # blocks written since, into the pools the workers made for the copy.
    precopied: bool = False

    def is_kept(self, worker: int) -> bool:
        """True when the worker's instance has the same workers before and after: nothing to do there."""
        role = self.new.role(worker)
        return role is not None and role[0] in self.kept

    def kept_workers(self) -> set[int]:
        return {w for w in range(self.new.num_workers) if self.is_kept(w)}

    def __post_init__(self):
        if self.weights_source not in WEIGHT_SOURCES:
            raise ValueError(f"weights_source must be one of {WEIGHT_SOURCES}, got {self.weights_source!r}")
        for idx, n in self.num_live_new_blocks.items():
            if n > self.new_num_blocks.get(idx, 0):
                raise ValueError(f"new instance {idx} needs {n} live KV blocks but holds "
                                 f"{self.new_num_blocks.get(idx, 0)}")


def _pages_of(block_ids, block_bytes: int, page_size: int) -> int:
    """Arena pages the blocks touch (blocks smaller than a page share pages)."""
    return len(block_pages(block_ids, block_bytes, page_size))


def transition_overflow(plan: ReshapePlan, footprints: list[dict]) -> list[tuple[int, int, int]]:
    """(worker, bytes needed, budget) of every changing worker whose budget the transaction would exceed before the
    commit point: the larger of its weights while the KV migrates and after the weights phase, its old pool's live
    blocks and its new pool's blocks (a deferred exchange: the most it commits at once, chunk by chunk) and the
    morph headroom. footprints[w]: Worker.reshape_footprint(old, new)."""
    over = []
    for worker, fp in enumerate(footprints):
        old_role, new_role = plan.old.role(worker), plan.new.role(worker)
        if plan.is_kept(worker) or (old_role is None and new_role is None):
            continue
        page = fp["page_size"]
        if plan.defer_kv and old_role and new_role:
            # The exchange commits the new pool chunk by chunk as it gives the old one back (exchange_schedule.py)
            kv = exchange_peak_bytes(exchange_schedule(plan.transfers, worker, plan.exchange_chunks),
                                     plan.live_old_blocks[old_role.instance], fp["old_block_bytes"],
                                     fp["new_block_bytes"], page, plan.num_live_new_blocks[new_role.instance])
        else:
            kv = (_pages_of(plan.live_old_blocks[old_role.instance], fp["old_block_bytes"], page) if old_role else 0) \
                + (_pages_of(range(plan.num_live_new_blocks[new_role.instance]), fp["new_block_bytes"], page)
                   if new_role else 0)
            kv *= page
        need = max(fp["weights_mid_bytes"], fp["weights_after_bytes"]) + kv + fp["headroom_bytes"]
        if need > fp["budget_bytes"]:
            over.append((worker, need, fp["budget_bytes"]))
    return over
