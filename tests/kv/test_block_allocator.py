import pytest

from elastic_hf.kv.block_allocator import BlockAllocator, NoFreeBlocksError


def test_allocate_and_free_counts():
    alloc = BlockAllocator(range(8))
    ids = alloc.allocate(5)
    assert len(set(ids)) == 5 and alloc.num_free == 3 and alloc.num_used == 5
    alloc.free(ids[:2])
    assert alloc.num_free == 5
    # Freed blocks are reused first.
    assert set(alloc.allocate(2)) == set(ids[:2])


def test_exhaustion_message_has_numbers():
    alloc = BlockAllocator(range(4))
    alloc.allocate(3)
    with pytest.raises(NoFreeBlocksError, match="need 2 blocks, 1 free of 4"):
        alloc.allocate(2)


def test_detach_takes_only_free_blocks_highest_first():
    alloc = BlockAllocator(range(6))
    live = alloc.allocate(4)  # 0..3 live
    detached = alloc.detach_free(5)
    assert sorted(detached) == [4, 5]
    assert alloc.num_total == 4 and alloc.num_free == 0
    alloc.free(live)
    assert alloc.detach_free(1) == [3]


def test_attach_grows_capacity_and_rejects_duplicates():
    alloc = BlockAllocator(range(2))
    alloc.attach([7, 9])
    assert alloc.num_total == 4 and alloc.can_allocate(4)
    with pytest.raises(ValueError, match="already attached"):
        alloc.attach([7])
    with pytest.raises(ValueError, match="not attached"):
        alloc.free([3])
