"""The order of a KV exchange (KunServe §4.2) and what it commits, torch-free: a parameter drop's exchange moves the
plan's transfers in chunks, and each worker commits its new pool's pages for a chunk's destination blocks just before
the chunk and gives back its old pool's pages of the source blocks the chunk read last, right after it. A member then
never holds its old pool (every layer of its requests) and the new one (its stage's layers of every request of the
group) at once, only what the chunks in flight add to the larger of the two: KunServe's in-place exchange, in
committed pages rather than in the same pages (a block of the old layout holds every layer, one of the new layout
its stage's, so the pools cannot share a page layout).

Every worker derives the same chunks from the same plan, so the point-to-point ops of a chunk pair up; the control
plane derives each worker's peak from them (reshape_plan.transition_overflow) before it commits to a drop, and uses
chunks only where both pools whole do not fit (each chunk is another round of ops per layer beside the steps)."""
from __future__ import annotations

from dataclasses import dataclass

from elastic_hf.kv.layout import block_pages
from elastic_hf.kv.migration_plan import KVTransfer

EXCHANGE_CHUNKS = 16   # a chunk adds ~1/16 of the moved KV to the peak; each costs one round of ops per layer


@dataclass(frozen=True, slots=True)
class ExchangeChunk:
    transfers: list[KVTransfer]        # this worker's share of the chunk (the same chunk on every worker)
    commit_blocks: tuple[int, ...]     # new-pool blocks first written here: committed before the chunk
    release_blocks: tuple[int, ...]    # old-pool blocks last read here: their pages go back after the chunk


def exchange_order(transfers: list[KVTransfer]) -> list[KVTransfer]:
    """The plan's transfers interleaved by source worker, in proportion to each one's count (each keeps its order):
    a member gives back its own old blocks while it receives its peers', instead of receiving them all first."""
    by_src: dict[int, list[KVTransfer]] = {}
    for t in transfers:
        by_src.setdefault(t.src_worker, []).append(t)
    taken = dict.fromkeys(by_src, 0)
    order = []
    for _ in range(len(transfers)):
        # the source furthest behind its share goes next (ties: the lower worker), the same on every worker
        src = min(by_src, key=lambda w: ((taken[w] + 1) / len(by_src[w]), w))
        order.append(by_src[src][taken[src]])
        taken[src] += 1
    return order


def exchange_schedule(transfers: list[KVTransfer], me: int, num_chunks: int = EXCHANGE_CHUNKS,
                      commit_lazily: bool = True) -> list[ExchangeChunk]:
    """Worker `me`'s chunks of the exchange of `transfers` (the whole plan, as every worker gets it). commit_lazily
    False: the destination pool is committed already (a kept pool receives into its own blocks), nothing to commit
    or give back per chunk."""
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1, got {num_chunks}")
    order = exchange_order(transfers)
    size = -(-len(order) // num_chunks) if order else 1
    slices = [order[i:i + size] for i in range(0, len(order), size)]
    last_read = {t.src_block: i for i, part in enumerate(slices) for t in part if t.src_worker == me}
    written: set[int] = set()
    chunks = []
    for i, part in enumerate(slices):
        mine = [t for t in part if me in (t.src_worker, t.dst_worker)]
        fresh = sorted({t.dst_block for t in mine if t.dst_worker == me} - written)
        written.update(fresh)
        done = sorted(b for b, at in last_read.items() if at == i)
        chunks.append(ExchangeChunk(mine, tuple(fresh) if commit_lazily else (),
                                    tuple(done) if commit_lazily else ()))
    return chunks


def lazy_blocks(chunks: list[ExchangeChunk]) -> set[int]:
    """The new pool's blocks the chunks commit (the others of its live blocks are committed up front)."""
    return {b for chunk in chunks for b in chunk.commit_blocks}


def exchange_peak_bytes(chunks: list[ExchangeChunk], old_live_blocks, old_block_bytes: int, new_block_bytes: int,
                        page_size: int, num_new_blocks: int = 0) -> int:
    """The most KV bytes a worker commits during its exchange: its old pool's live blocks and the new pool's blocks
    0 .. num_new_blocks - 1 that no chunk commits at the start, plus each chunk's new blocks before that chunk, less
    the old blocks given back after it (whole pages: blocks smaller than a page share pages, which stay committed
    while any of their blocks does)."""
    def pages(blocks, block_bytes):
        return block_pages(blocks, block_bytes, page_size)

    old_live = set(old_live_blocks)
    lazy = lazy_blocks(chunks)
    old_pages = pages(old_live, old_block_bytes)
    new_pages = pages((b for b in range(num_new_blocks) if b not in lazy), new_block_bytes)
    peak = len(old_pages) + len(new_pages)
    for chunk in chunks:
        new_pages |= pages(chunk.commit_blocks, new_block_bytes)
        peak = max(peak, len(old_pages) + len(new_pages))
        old_live.difference_update(chunk.release_blocks)
        old_pages -= pages(chunk.release_blocks, old_block_bytes) - pages(old_live, old_block_bytes)
    return peak * page_size
