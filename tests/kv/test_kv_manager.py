"""The KV manager owns the allocator and the size of its instance's page pools: every grow, shrink and reset goes to
all pools of the instance through its channel, and afterwards the allocator's blocks are exactly the blocks every
pool has committed. Real pools on real arenas (committed bytes in the budget), two of them as for a TP2 instance."""
import random

import pytest
import torch

from elastic_hf.kv.kv_manager import KVManager, KVResize, NoFreeBlocksError
from elastic_hf.kv.layout import KVLayout
from elastic_hf.kv.page_pool import KVPagePool
from elastic_hf.memory import MemoryBudget, create_arena

BLOCK, MAX_BLOCKS = 4, 32


def _pools(num_pools: int, num_blocks: int):
    layout = KVLayout(2, 2, 16, BLOCK, torch.float32, 4096)
    pools = []
    for _ in range(num_pools):
        budget = MemoryBudget(1 << 30)
        pools.append(KVPagePool(layout, create_arena("cpu", MAX_BLOCKS * layout.block_bytes, budget, "kv"),
                                MAX_BLOCKS, num_blocks))
    return pools


def _manager(num_blocks: int, num_pools: int = 2):
    pools = _pools(num_pools, num_blocks)
    sent = []

    def channel(resize):
        sent.append(resize)
        return [pool.resize(resize) for pool in pools]

    return KVManager(num_blocks, BLOCK, channel), pools, sent


def _attached(kv: KVManager) -> list[int]:
    return [b for b in range(MAX_BLOCKS) if kv.is_attached(b)]


def _agree(kv, pools):
    for pool in pools:
        assert pool.attached_ids() == _attached(kv)
        # blocks of 2 KiB share 4 KiB pages: the pages the attached blocks touch are committed, and no others
        pages = {p for b in _attached(kv) for p in range(*pool.layout.page_span(b))}
        assert pool.committed_bytes == len(pages) * pool.arena.page_size


def test_grow_and_shrink_reach_every_pool_and_never_take_a_live_block():
    kv, pools, sent = _manager(8)
    live = kv.allocate(6)
    assert kv.grow(4) == [8, 9, 10, 11] and kv.num_free == 6
    _agree(kv, pools)
    given_up = kv.shrink(20)                  # only the free ones go, highest ids first
    assert sorted(given_up) == [6, 7, 8, 9, 10, 11] and set(given_up).isdisjoint(live)
    _agree(kv, pools)
    assert kv.shrink(3) == [] and len(sent) == 2   # nothing free: no resize is sent
    kv.free(live)
    kv.shrink_to(2)
    assert _attached(kv) == [0, 1]
    _agree(kv, pools)


def test_reset_makes_every_pool_hold_the_first_blocks_again():
    kv, pools, _ = _manager(8)
    kv.shrink(3)
    pools[1].resize(KVResize(attach=2))   # a survivor of an interrupted exchange committed more than the manager
    kv.reset(10)
    assert _attached(kv) == list(range(10)) and kv.num_free == 10
    _agree(kv, pools)
    kv.allocate(1)
    with pytest.raises(RuntimeError, match="still in use"):
        kv.reset(10)


def test_a_failed_resize_leaves_the_manager_as_it_was():
    pools = _pools(1, 8)

    def broken(resize):
        raise OSError("worker 1 is gone")

    kv = KVManager(8, BLOCK, broken)
    with pytest.raises(OSError):
        kv.shrink(2)
    assert kv.num_total == 8 and kv.num_free == 8
    with pytest.raises(OSError):
        kv.grow(2)
    assert kv.num_total == 8
    assert pools[0].num_blocks == 8


def test_a_manager_without_pools_has_a_fixed_capacity():
    kv = KVManager(8, BLOCK)
    with pytest.raises(RuntimeError, match="no page pools bound"):
        kv.grow(1)
    with pytest.raises(NoFreeBlocksError, match="need 9 blocks, 8 free of 8"):
        kv.allocate(9)


def test_limit_to_pools_drops_the_planned_blocks_no_pool_committed():
    plan = KVManager(12, BLOCK)           # a reshape plans the new instance at its capacity
    moved = plan.allocate(3)              # the moved requests' blocks: 0, 1, 2
    plan.limit_to_pools(3)                # the deferred commit made pools of exactly those
    assert moved == [0, 1, 2] and _attached(plan) == [0, 1, 2] and plan.num_free == 0
    pools = _pools(2, 3)
    plan.bind_pools(lambda resize: [pool.resize(resize) for pool in pools])
    plan.grow(5)                          # the exchange's end: the old pools' bytes become blocks
    _agree(plan, pools)


def test_random_resizes_keep_manager_and_pools_in_agreement():
    rng = random.Random(0)
    kv, pools, _ = _manager(8)
    held: list[list[int]] = []
    for _ in range(300):
        op = rng.choice(["alloc", "free", "grow", "shrink", "share"])
        if op == "alloc" and kv.num_free:
            held.append(kv.allocate(rng.randint(1, kv.num_free)))
        elif op == "free" and held:
            kv.free(held.pop(rng.randrange(len(held))))
        elif op == "share" and held:
            blocks = rng.choice(held)
            kv.share(blocks)
            held.append(list(blocks))
        elif op == "grow":
            kv.grow(min(rng.randint(0, 4), MAX_BLOCKS - kv.num_total))
        elif op == "shrink":
            kv.shrink(rng.randint(0, 4))
        in_use = {b for blocks in held for b in blocks}
        assert all(kv.is_attached(b) for b in in_use)
        _agree(kv, pools)
