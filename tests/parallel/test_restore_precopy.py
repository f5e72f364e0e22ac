"""The pins of a restore's KV pre-copy (parallel/reshape.PreCopy), torch-free: a sequence keeps its copied blocks
only while they are still its blocks; otherwise its new blocks go back and it is placed like any other."""
from types import SimpleNamespace

from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.sequence import Sequence
from elastic_hf.kv.kv_manager import KVManager
from elastic_hf.parallel.reshape import PinnedSeq, PreCopy


def _seq(seq_id: int, blocks: list[int], preemptions: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, list(range(40)), 40, SamplingParams(), 0.0, block_ids=list(blocks),
                    num_computed_tokens=32, num_preemptions=preemptions)


def _precopy() -> tuple[PreCopy, KVManager]:
    kv = KVManager(16, 16)
    pins = {}
    for seq_id, old in ((1, (3, 4, 5)), (2, (6, 7, 8))):
        new = tuple(kv.allocate(3))
        pins[seq_id] = PinnedSeq(0, old[:2], new, 0)   # two full blocks copied, the partial third not
    return PreCopy({0: kv}, pins), kv


def test_a_sequence_that_kept_its_blocks_keeps_its_pin():
    precopy, kv = _precopy()
    grown = SimpleNamespace(seqs=[_seq(1, [3, 4, 5, 9])])   # one more block since the copy
    pins = precopy.pins_of(grown)
    assert pins == {1: precopy.pinned[1]} and kv.num_used == 6


def test_a_preempted_or_reallocated_sequence_loses_its_pin_and_its_new_blocks():
    precopy, kv = _precopy()
    assert precopy.pins_of(SimpleNamespace(seqs=[_seq(1, [3, 4, 5], preemptions=1)])) is None
    assert 1 not in precopy.pinned and kv.num_used == 3
    assert precopy.pins_of(SimpleNamespace(seqs=[_seq(2, [6, 10, 11])])) is None   # recomputed into other blocks
    assert not precopy.pinned and kv.num_used == 0


def test_discarding_twice_frees_once():
    precopy, kv = _precopy()
    precopy.discard(1)
    precopy.discard(1)
    assert kv.num_used == 3


def test_a_sequence_without_blocks_gives_its_pin_back_and_its_sibling_keeps_its_own():
    """A finished sibling of an n > 1 request (or a preempted one still waiting) holds no blocks: nothing of it
    moves, so its pinned blocks go back, while the sibling that runs on keeps its pin."""
    precopy, kv = _precopy()
    request = SimpleNamespace(seqs=[_seq(1, [3, 4, 5]), _seq(2, [])])
    pins = precopy.pins_of(request)
    assert pins == {1: precopy.pinned[1]} and 2 not in precopy.pinned and kv.num_used == 3
