"""Two-dimensional KV migration plans (ReMP §3.5, Gyges §4.1.2), torch-free: which (block, KV-head range) goes from
which worker of the old topology to which worker of the new one. The control plane builds the plan once and sends it
to every worker, so all of them agree on the order of the packed rows; parallel/kv_migration.py executes it."""
from __future__ import annotations

from dataclasses import dataclass

from elastic_hf.layers.shard_layout import split_units


@dataclass(frozen=True, slots=True)
class KVTransfer:
    src_worker: int
    dst_worker: int
    src_block: int
    dst_block: int
    head_start: int   # global KV heads [head_start, head_end)
    head_end: int


@dataclass(frozen=True, slots=True)
class BlockMove:
    """One sequence's blocks leaving old instance `src_instance` for new instance `dst_instance`."""
    src_instance: int
    dst_instance: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]

    def __post_init__(self):
        if len(self.src_blocks) != len(self.dst_blocks):
            raise ValueError(f"a move maps {len(self.src_blocks)} blocks onto {len(self.dst_blocks)}")


def head_range(num_kv_heads: int, tp: int, rank: int) -> tuple[int, int]:
    return split_units(num_kv_heads, tp)[rank]


def build_migration_plan(moves: list[BlockMove], old, new, num_kv_heads: int) -> list[KVTransfer]:
    """Receiver side first (ReMP Alg. 1): every new rank's head range intersected with every old rank's range."""
    old_instances, new_instances = old.instances(), new.instances()
    transfers: list[KVTransfer] = []
    for move in moves:
        src_workers, dst_workers = old_instances[move.src_instance], new_instances[move.dst_instance]
        for d_rank, dst in enumerate(dst_workers):
            d_lo, d_hi = head_range(num_kv_heads, len(dst_workers), d_rank)
            for s_rank, src in enumerate(src_workers):
                s_lo, s_hi = head_range(num_kv_heads, len(src_workers), s_rank)
                lo, hi = max(d_lo, s_lo), min(d_hi, s_hi)
                if lo >= hi:
                    continue
                for sb, db in zip(move.src_blocks, move.dst_blocks):
                    transfers.append(KVTransfer(src, dst, sb, db, lo, hi))
    return transfers
