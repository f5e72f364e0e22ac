"""What a reshape transaction does, as data (torch-free): built by the control plane from its schedulers, sent to
every worker, executed there up to the commit point."""
from __future__ import annotations

from dataclasses import dataclass, field

from elastic_hf.parallel.groups import Topology
from elastic_hf.parallel.kv_migration import BlockMove, KVTransfer


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

    def __post_init__(self):
        if self.old.num_workers != self.new.num_workers:
            raise ValueError(f"reshape {self.old} -> {self.new} changes the number of active workers "
                             f"({self.old.num_workers} -> {self.new.num_workers}); standby moves are not planned")
        for idx, n in self.num_live_new_blocks.items():
            if n > self.new_num_blocks.get(idx, 0):
                raise ValueError(f"new instance {idx} needs {n} live KV blocks but holds "
                                 f"{self.new_num_blocks.get(idx, 0)}")
