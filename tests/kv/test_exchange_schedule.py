"""A parameter drop's KV exchange in chunks (kv/exchange_schedule.py, torch-free): every worker's share of the plan
runs exactly once, a destination block is committed before its first write and a source block given back only after
its last read, and the most a member commits at once stays near the larger of its old and new pools instead of
their sum (what made drops into a KV-bound burst refuse or preempt)."""
import pytest

from elastic_hf.kv.exchange_schedule import exchange_order, exchange_peak_bytes, exchange_schedule
from elastic_hf.kv.migration_plan import BlockMove, build_migration_plan
from elastic_hf.topology import parse_topology

LAYERS, HEADS, PAGE = 30, 3, 4096
LAYER_BYTES = HEADS * 2 * 16 * 64 * 4   # one layer of a 16-token block of SmolLM2's shape in fp32: 6 pages


def _drop_plan(blocks_per_instance: int, new: str = "1x2:17/13"):
    """Both DP instances' requests (3 blocks each, arriving alternately) merge into one pipeline."""
    moves, next_new = [], 0
    for seq in range(blocks_per_instance // 3):
        for inst in (0, 1):
            src = tuple(range(3 * seq, 3 * seq + 3))
            moves.append(BlockMove(inst, 0, src, tuple(range(next_new, next_new + 3))))
            next_new += 3
    return build_migration_plan(moves, parse_topology("1,1"), parse_topology(new), HEADS, LAYERS), next_new


def test_the_order_interleaves_sources_in_proportion_and_keeps_each_ones_order():
    transfers, _ = _drop_plan(30)
    order = exchange_order(transfers)
    assert sorted(order, key=transfers.index) == transfers
    for src in (0, 1):
        assert [t for t in order if t.src_worker == src] == [t for t in transfers if t.src_worker == src]
    first_half = order[:len(order) // 2]
    share = sum(t.src_worker == 0 for t in first_half) / len(first_half)
    assert 0.45 <= share <= 0.55, share


@pytest.mark.parametrize("me", [0, 1])
def test_every_transfer_runs_once_with_its_blocks_committed_before_and_given_back_after(me):
    transfers, num_new = _drop_plan(60)
    chunks = exchange_schedule(transfers, me, num_chunks=16)
    assert len(chunks) == 16
    mine = [t for t in transfers if me in (t.src_worker, t.dst_worker)]
    ran = [t for c in chunks for t in c.transfers]
    assert sorted(ran, key=mine.index) == mine
    committed, released = set(), set()
    for chunk in chunks:
        committed.update(chunk.commit_blocks)
        for t in chunk.transfers:
            if t.dst_worker == me:
                assert t.dst_block in committed
            if t.src_worker == me:
                assert t.src_block not in released
        released.update(chunk.release_blocks)
    assert committed == {t.dst_block for t in mine if t.dst_worker == me} == set(range(num_new))
    assert released == {t.src_block for t in mine if t.src_worker == me} == set(range(60))
    eager = exchange_schedule(transfers, me, num_chunks=16, commit_lazily=False)
    assert [c.transfers for c in eager] == [c.transfers for c in chunks]
    assert not any(c.commit_blocks or c.release_blocks for c in eager)


@pytest.mark.parametrize("me,new_layers", [(0, 17), (1, 13)])
def test_a_members_peak_is_the_larger_pool_plus_a_chunk_not_both_pools(me, new_layers):
    transfers, num_new = _drop_plan(240)
    old_block, new_block = LAYERS * LAYER_BYTES, new_layers * LAYER_BYTES
    old_bytes, new_bytes = 240 * old_block, num_new * new_block
    chunks = exchange_schedule(transfers, me, num_chunks=16)
    peak = exchange_peak_bytes(chunks, range(240), old_block, new_block, PAGE)
    larger = max(old_bytes, new_bytes)
    assert larger <= peak <= larger + (old_bytes + new_bytes) / 8, (peak, old_bytes, new_bytes)
    # One chunk is the old way: both pools whole at once.
    whole = exchange_peak_bytes(exchange_schedule(transfers, me, num_chunks=1), range(240), old_block, new_block,
                                PAGE)
    assert whole == old_bytes + new_bytes
    # Blocks no chunk writes are committed from the start.
    assert exchange_peak_bytes(chunks, range(240), old_block, new_block, PAGE, num_new + 10) == peak + 10 * new_block


def test_blocks_smaller_than_a_page_keep_shared_pages_until_both_neighbours_go():
    transfers, num_new = _drop_plan(6)
    chunks = exchange_schedule(transfers, 0, num_chunks=4)
    # 3 KiB blocks: pages hold parts of two blocks; the peak counts whole pages
    peak = exchange_peak_bytes(chunks, range(6), 3072, 1536, PAGE)
    assert peak % PAGE == 0 and peak >= PAGE * -(-6 * 3072 // PAGE)
