"""Execution of a two-dimensional KV migration plan (kv/migration_plan.py, ReMP §3.5, Gyges §4.1.2) on one worker,
layer by layer from the last layer.

With the head-centric layout every (block, layer, head range) is one contiguous run of rows in the pool, so a
transfer is an index_select on the sender and an index_copy_ on the receiver; tensors move only through
torch.distributed point-to-point ops."""
from __future__ import annotations

from elastic_hf.kv.migration_plan import KVTransfer


def migrate_kv(transfers: list[KVTransfer], me: int, old_pool, old_head_start: int, new_pool,
               new_head_start: int) -> dict:
    """Execute this worker's share of the plan. Returns bytes moved locally / sent / received and the largest
    per-layer staging buffer (the peak extra bytes beyond the new pool's pages)."""
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

    local_src, local_dst = [], []
    send: dict[int, list[torch.Tensor]] = {}
    recv: dict[int, list[torch.Tensor]] = {}
    for t in transfers:
        n = t.head_end - t.head_start
        if t.src_worker == me:
            src = rows(t.src_block, t.head_start, n, old_lo, old_head_start)
            if t.dst_worker == me:
                local_src.append(src)
                local_dst.append(rows(t.dst_block, t.head_start, n, new_lo, new_head_start))
            else:
                send.setdefault(t.dst_worker, []).append(src)
        elif t.dst_worker == me:
            recv.setdefault(t.src_worker, []).append(rows(t.dst_block, t.head_start, n, new_lo, new_head_start))
    cat = lambda parts: torch.cat(parts).to(device) if parts else None  # noqa: E731
    local_src_rows, local_dst_rows = cat(local_src), cat(local_dst)
    send_rows = {peer: cat(parts) for peer, parts in sorted(send.items())}
    recv_rows = {peer: cat(parts) for peer, parts in sorted(recv.items())}

    row_bytes = old_lo.head_dim * old_lo.itemsize
    stats = {"local_bytes": 0, "sent_bytes": 0, "received_bytes": 0, "peak_staging_bytes": 0}
    old_rows = old_pool.rows if old_pool is not None else None   # [arena rows, head_dim]
    new_rows = new_pool.rows if new_pool is not None else None
    for layer in reversed(range(old_lo.num_layers)):
        o_off, n_off = layer * old_lo.rows_per_layer, layer * new_lo.rows_per_layer
        ops, inbox, staging = [], [], 0
        for peer, idx in send_rows.items():
            buf = old_rows.index_select(0, idx + o_off)                 # [rows, head_dim]
            ops.append(dist.P2POp(dist.isend, buf, peer))
            staging += buf.numel() * buf.element_size()
        for peer, idx in recv_rows.items():
            buf = torch.empty(idx.numel(), new_lo.head_dim, dtype=new_lo.dtype, device=device)  # [rows, head_dim]
            ops.append(dist.P2POp(dist.irecv, buf, peer))
            inbox.append((idx, buf))
            staging += buf.numel() * buf.element_size()
        works = dist.batch_isend_irecv(ops) if ops else []
        if local_src_rows is not None:  # overlaps the transfers
            new_rows.index_copy_(0, local_dst_rows + n_off, old_rows.index_select(0, local_src_rows + o_off))
        for w in works:
            w.wait()
        for idx, buf in inbox:
            new_rows.index_copy_(0, idx + n_off, buf)
        stats["peak_staging_bytes"] = max(stats["peak_staging_bytes"], staging)
    num_layers = old_lo.num_layers
    stats["local_bytes"] = (0 if local_src_rows is None else local_src_rows.numel()) * row_bytes * num_layers
    stats["sent_bytes"] = sum(i.numel() for i in send_rows.values()) * row_bytes * num_layers
    stats["received_bytes"] = sum(i.numel() for i in recv_rows.values()) * row_bytes * num_layers
    return stats
