"""Torch-free scheduler: token budget, chunked prefill, admission, preemption by recompute, block release."""
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.config import EngineConfig
from elastic_hf.engine.scheduler import Scheduler
from elastic_hf.engine.sequence import Sequence, SeqStatus
from elastic_hf.engine.step_plan import ModelRunnerOutput
from elastic_hf.kv.kv_manager import KVManager


def _seq(i, prompt_len):
    return Sequence(i, f"r{i}", 0, list(range(prompt_len)), prompt_len, SamplingParams(max_tokens=100), 0.0)


def _advance(sched, scheduled):
    """What the engine does with a step's result: every sampling row gets the token 7."""
    sched.update_from_output(scheduled, ModelRunnerOutput([7] * len(scheduled.sampling_seqs)))


def test_chunked_prefill_respects_token_budget():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=10, block_size=4)
    sched = Scheduler(config, KVManager(32, 4))
    a, b = _seq(0, 25), _seq(1, 3)
    sched.add(a), sched.add(b)
    steps = []
    while a.num_computed_tokens < 25:
        scheduled = sched.schedule()
        assert sum(s.num_new_tokens for s in scheduled) <= 10
        steps.append([(s.seq.seq_id, s.num_new_tokens) for s in scheduled])
        _advance(sched, scheduled)
    assert steps[0] == [(0, 10)]
    assert steps[1] == [(0, 10)]
    assert steps[2] == [(0, 5), (1, 3)]


def test_preemption_by_recompute_frees_blocks_and_requeues_youngest():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    sched = Scheduler(config, KVManager(4, 4))
    old, young = _seq(0, 8), _seq(1, 7)
    sched.add(old), sched.add(young)
    _advance(sched, sched.schedule())  # both admitted: 2 + 2 blocks, 9 and 8 tokens now
    assert sched.kv.num_free == 0
    scheduled = sched.schedule()  # old needs a third block: young is preempted
    assert [s.seq for s in scheduled] == [old]
    assert young.status is SeqStatus.WAITING and young.num_computed_tokens == 0 and young.block_ids == []
    assert young.token_ids[-1] == 7  # its generated token stays and is recomputed
    assert sched.num_preemptions == 1 and sched.waiting[0] is young


def test_finish_releases_blocks_at_once():
    alloc = KVManager(8, 4)
    sched = Scheduler(EngineConfig(block_size=4), alloc)
    seq = _seq(0, 10)
    sched.add(seq)
    sched.schedule()
    assert alloc.num_used == 3
    sched.finish(seq, "abort")
    assert alloc.num_used == 0 and seq.status is SeqStatus.FINISHED and not sched.has_work()


def test_max_num_seqs_caps_admission():
    sched = Scheduler(EngineConfig(max_num_seqs=2, block_size=4), KVManager(64, 4))
    for i in range(5):
        sched.add(_seq(i, 3))
    assert len(sched.schedule()) == 2 and len(sched.waiting) == 3


def test_adopted_sequences_keep_admission_order():
    sched = Scheduler(EngineConfig(block_size=4), KVManager(64, 4))
    mine = [_seq(i, 3) for i in (0, 4)]
    for seq in mine:
        sched.add(seq)
    sched.schedule()
    moved_running, moved_waiting = _seq(2, 3), _seq(3, 3)
    moved_running.status = SeqStatus.RUNNING
    sched.adopt([moved_running], [moved_waiting])
    assert [s.seq_id for s in sched.running] == [0, 2, 4] and [s.seq_id for s in sched.waiting] == [3]
    head, blocked = sched.head_of_line()
    assert head is moved_waiting and not blocked


def test_sequences_in_flight_are_neither_scheduled_again_nor_preempted():
    """Cross-step pipelining (engine/batch_queue.py): a batch takes at most max_seqs sequences; while its step is in
    flight its sequences are skipped, and when blocks run out the youngest sequence *not* in flight is preempted."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    sched = Scheduler(config, KVManager(6, 4))
    seqs = [_seq(i, 4) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    first = sched.schedule(max_seqs=2)
    assert [s.seq for s in first] == seqs[:2] and list(sched.waiting) == [seqs[2]]
    sched.in_flight.update(s.seq.seq_id for s in first)
    assert sched.num_runnable() == 1
    second = sched.schedule()
    assert [s.seq for s in second] == [seqs[2]]       # the in-flight pair is not scheduled twice
    _advance(sched, second)
    sched.in_flight.add(seqs[2].seq_id)
    assert not sched.schedule()                          # everything is in flight
    sched.in_flight.difference_update(s.seq.seq_id for s in first)
    _advance(sched, first)
    # 3 blocks used, 3 free; seqs 0 and 1 need a second block each, seq 2 (in flight, youngest) must not go
    sched.kv.allocate(2)                                 # leave one free block
    third = sched.schedule()
    assert [s.seq for s in third] == [seqs[0]]           # seq 1 preempted (youngest not in flight), not seq 2
    assert seqs[1].status is SeqStatus.WAITING and seqs[2].status is SeqStatus.RUNNING
