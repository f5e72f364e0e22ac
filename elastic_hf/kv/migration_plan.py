"""Two-dimensional KV migration plans (ReMP §3.5, Algorithm 1; Gyges §4.1.2), torch-free: which (block, layer range,
KV-head range) goes from which worker of the old topology to which worker of the new one. Every new rank intersects
its target (layer range of its pipeline stage x head range of its TP rank) with every old rank's; the control plane
builds the plan once and sends it to every worker, so all of them agree on the order of the packed rows;
parallel/kv_migration.py executes it. `check_plan` verifies the invariants of ReMP §3.5.5 on the plan itself."""
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
    layer_start: int  # model layers [layer_start, layer_end)
    layer_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start


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


def worker_extents(topology, instance: int, num_kv_heads: int, num_layers: int):
    """(worker, (layer_start, layer_end), (head_start, head_end)) of every worker of an instance."""
    shape = topology.shapes[instance]
    bounds = shape.stage_bounds(num_layers)
    out = []
    for stage, workers in enumerate(topology.stages(instance)):
        for rank, worker in enumerate(workers):
            out.append((worker, bounds[stage], head_range(num_kv_heads, shape.tp, rank)))
    return out


def build_migration_plan(moves: list[BlockMove], old, new, num_kv_heads: int, num_layers: int) -> list[KVTransfer]:
    """Receiver side first (ReMP Alg. 1): every new rank's (layer range x head range) intersected with every old
    rank's; a non-empty intersection is one transfer per moved block."""
    transfers: list[KVTransfer] = []
    for move in moves:
        sources = worker_extents(old, move.src_instance, num_kv_heads, num_layers)
        for dst, (dl0, dl1), (dh0, dh1) in worker_extents(new, move.dst_instance, num_kv_heads, num_layers):
            for src, (sl0, sl1), (sh0, sh1) in sources:
                l0, l1, h0, h1 = max(dl0, sl0), min(dl1, sl1), max(dh0, sh0), min(dh1, sh1)
                if l0 >= l1 or h0 >= h1:
                    continue
                for sb, db in zip(move.src_blocks, move.dst_blocks):
                    transfers.append(KVTransfer(src, dst, sb, db, h0, h1, l0, l1))
    return transfers


def plan_payload_bytes(transfers: list[KVTransfer], block_size: int, head_dim: int, itemsize: int) -> dict:
    """Bytes the plan moves: between workers (`sent`) and inside one worker (`local`)."""
    per_head_layer = 2 * block_size * head_dim * itemsize   # K and V of one head of one layer of one block
    sent = local = 0
    for t in transfers:
        nbytes = t.num_heads * t.num_layers * per_head_layer
        if t.src_worker == t.dst_worker:
            local += nbytes
        else:
            sent += nbytes
    return {"sent": sent, "local": local}


def check_plan(moves: list[BlockMove], transfers: list[KVTransfer], old, new, num_kv_heads: int,
               num_layers: int) -> None:
    """ReMP §3.5.5 on the plan: for every moved block, the transfers into each new owner tile that owner's
    (layer range x head range) exactly once (no gap, no overlap, nothing outside it), and every transfer lands in
    the destination block of its move (logical block identity). Works on rectangles, not on single (layer, head)
    cells, so it costs a few comparisons per block. Raises ValueError naming the first violation."""
    # A block shared by several sequences (a cached prefix) is copied once per sequence that moves with it
    destination: dict[tuple[int, int], set[int]] = {}
    for move in moves:
        for sb, db in zip(move.src_blocks, move.dst_blocks):
            destination.setdefault((move.src_instance, sb), set()).add(db)
    owners: dict[int, dict[int, tuple]] = {}   # new instance -> worker -> (layers, heads)
    incoming: dict[tuple[int, int], list[KVTransfer]] = {}
    for t in transfers:
        incoming.setdefault((t.dst_worker, t.dst_block), []).append(t)
    seen = set()
    for move in moves:
        if move.dst_instance not in owners:
            owners[move.dst_instance] = {w: (layers, heads) for w, layers, heads in
                                         worker_extents(new, move.dst_instance, num_kv_heads, num_layers)}
        for db in move.dst_blocks:
            for worker, ((l0, l1), (h0, h1)) in owners[move.dst_instance].items():
                seen.add((worker, db))
                rects = [(t.layer_start, t.layer_end, t.head_start, t.head_end) for t in incoming.get((worker, db), [])]
                for a0, a1, b0, b1 in rects:
                    if a0 < l0 or a1 > l1 or b0 < h0 or b1 > h1:
                        raise ValueError(f"KV plan sends layers [{a0}, {a1}) heads [{b0}, {b1}) of block {db} to "
                                         f"worker {worker}, which holds layers [{l0}, {l1}) heads [{h0}, {h1})")
                for i, (a0, a1, b0, b1) in enumerate(rects):
                    for c0, c1, d0, d1 in rects[i + 1:]:
                        if max(a0, c0) < min(a1, c1) and max(b0, d0) < min(b1, d1):
                            raise ValueError(f"KV plan covers layers [{max(a0, c0)}, {min(a1, c1)}) heads "
                                             f"[{max(b0, d0)}, {min(b1, d1)}) of block {db} on worker {worker} twice")
                area = sum((a1 - a0) * (b1 - b0) for a0, a1, b0, b1 in rects)
                if area != (l1 - l0) * (h1 - h0):
                    raise ValueError(f"KV plan covers {area} of the {(l1 - l0) * (h1 - h0)} (layer, head) cells of "
                                     f"block {db} on worker {worker}")
    for t in transfers:
        role = old.role(t.src_worker)
        if role is None or t.dst_block not in destination.get((role.instance, t.src_block), ()) \
                or (t.dst_worker, t.dst_block) not in seen:
            raise ValueError(f"KV plan moves block {t.src_block} of worker {t.src_worker} into block {t.dst_block} "
                             f"on worker {t.dst_worker}, which is not where its move puts it")
