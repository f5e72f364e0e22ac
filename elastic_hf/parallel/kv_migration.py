"""Execution of a two-dimensional KV migration plan (kv/migration_plan.py, ReMP §3.5, Gyges §4.1.2) on one worker,
layer by layer from the last layer.

With the head-centric layout every (block, layer, head range) is one contiguous run of rows in the pool, so a
transfer is an index_select on the sender and an index_copy_ on the receiver; tensors move only through
torch.distributed point-to-point ops."""
from __future__ import annotations

from collections.abc import Callable

from elastic_hf.kv.migration_plan import KVTransfer


def migrate_kv(transfers: list[KVTransfer], me: int, old_pool, old_head_start: int, new_pool,
               new_head_start: int, layers: tuple[int, int] | None = None, group=None,
               after_layer: Callable[[dict], None] | None = None) -> dict:
    """Execute this worker's share of the plan, one model layer at a time from the last, so the staging buffers
    hold at most one layer's share (ReMP §3.5.4). A pool's layout says which layers it holds (a pipeline stage's
    range). Returns bytes moved locally / sent / received and the largest per-layer staging buffer (the peak extra
    bytes beyond the new pool's pages). layers=(start, end): only those model layers (a chunk of a KV exchange;
    every worker of the plan must pass the same range). group: the process group of the point-to-point ops (None:
    the default one; peers are global ranks either way). after_layer(stats) runs after each layer (a KV exchange
    paces itself there, and may raise to stop)."""
    import torch
    import torch.distributed as dist

    # Either pool may be None: a worker waking from standby only receives, one going to standby only sends.
    old_lo = old_pool.layout if old_pool is not None else new_pool.layout
    new_lo = new_pool.layout if new_pool is not None else old_lo
    bs = old_lo.block_size
    device = (new_pool if new_pool is not None else old_pool).rows.device

    def rows(block: int, heads_from: int, num_heads: int, lo, head_start: int) -> torch.Tensor:
        start = block * lo.rows_per_block + (heads_from - head_start) * 2 * bs
        return torch.arange(start, start + num_heads * 2 * bs)  # K and V of each head are adjacent

    # Row ids within a layer, grouped by the transfers' layer range (few distinct ranges: stage intersections).
    groups: dict[tuple[int, int], dict] = {}
    for t in transfers:
        if me not in (t.src_worker, t.dst_worker):
            continue
        g = groups.setdefault((t.layer_start, t.layer_end), {"local_src": [], "local_dst": [], "send": {},
                                                             "recv": {}})
        n = t.num_heads
        if t.src_worker == me:
            src = rows(t.src_block, t.head_start, n, old_lo, old_head_start)
            if t.dst_worker == me:
                g["local_src"].append(src)
                g["local_dst"].append(rows(t.dst_block, t.head_start, n, new_lo, new_head_start))
            else:
                g["send"].setdefault(t.dst_worker, []).append(src)
        else:
            g["recv"].setdefault(t.src_worker, []).append(rows(t.dst_block, t.head_start, n, new_lo, new_head_start))
    cat = lambda parts: torch.cat(parts).to(device) if parts else None  # noqa: E731
    for g in groups.values():
        g["local_src"], g["local_dst"] = cat(g["local_src"]), cat(g["local_dst"])
        g["send"] = {peer: cat(parts) for peer, parts in g["send"].items()}
        g["recv"] = {peer: cat(parts) for peer, parts in g["recv"].items()}

    row_bytes = old_lo.head_dim * old_lo.itemsize
    stats = {"local_bytes": 0, "sent_bytes": 0, "received_bytes": 0, "peak_staging_bytes": 0}
    old_rows = old_pool.rows if old_pool is not None else None   # [arena rows, head_dim]
    new_rows = new_pool.rows if new_pool is not None else None
    cache: dict[tuple, tuple[dict, dict]] = {}

    def merged(keys: tuple) -> tuple[dict, dict]:
        """Row ids per peer of the groups covering a layer; consecutive layers share their groups, so once each."""
        if keys not in cache:
            active = [groups[k] for k in keys]
            cache[keys] = tuple({peer: torch.cat([g[way][peer] for g in active if peer in g[way]])
                                 for peer in sorted({p for g in active for p in g[way]})} for way in ("send", "recv"))
        return cache[keys]

    last_layer = max((end for _, end in groups), default=0)
    lo, hi = layers if layers is not None else (0, last_layer)
    for layer in reversed(range(max(lo, 0), min(hi, last_layer))):
        keys = tuple(key for key in groups if key[0] <= layer < key[1])
        if not keys:
            continue
        active = [groups[key] for key in keys]
        # Offsets of this model layer inside each pool (pools of pipeline stages start at their first layer).
        o_off = (layer - old_lo.first_layer) * old_lo.rows_per_layer
        n_off = (layer - new_lo.first_layer) * new_lo.rows_per_layer
        send, recv = merged(keys)
        ops, inbox, staging = [], [], 0
        for peer, idx in send.items():
            buf = old_rows.index_select(0, idx + o_off)                 # [rows, head_dim]
            ops.append(dist.P2POp(dist.isend, buf, peer, group))
            staging += buf.numel() * buf.element_size()
            stats["sent_bytes"] += buf.numel() * buf.element_size()
        for peer, idx in recv.items():
            buf = torch.empty(idx.numel(), new_lo.head_dim, dtype=new_lo.dtype, device=device)  # [rows, head_dim]
            ops.append(dist.P2POp(dist.irecv, buf, peer, group))
            inbox.append((idx, buf))
            staging += buf.numel() * buf.element_size()
            stats["received_bytes"] += buf.numel() * buf.element_size()
        works = dist.batch_isend_irecv(ops) if ops else []
        for g in active:  # local copies overlap the transfers
            if g["local_src"] is not None:
                new_rows.index_copy_(0, g["local_dst"] + n_off, old_rows.index_select(0, g["local_src"] + o_off))
                stats["local_bytes"] += g["local_src"].numel() * row_bytes
        for w in works:
            w.wait()
        for idx, buf in inbox:
            new_rows.index_copy_(0, idx + n_off, buf)
        stats["peak_staging_bytes"] = max(stats["peak_staging_bytes"], staging)
        if after_layer is not None:
            after_layer(stats)
    return stats
