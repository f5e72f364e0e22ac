"""Torch-free scheduler: token budget, chunked prefill, admission, preemption by recompute, block release."""
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.config import EngineConfig
from elastic_hf.engine.scheduler import Scheduler
from elastic_hf.engine.sequence import Sequence, SeqStatus
from elastic_hf.engine.step_plan import ModelRunnerOutput, ScheduledSeq, SchedulerOutput
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
    sched.send(first)
    assert sched.num_runnable() == 1
    second = sched.schedule()
    assert [s.seq for s in second] == [seqs[2]]       # the in-flight pair samples: it is not scheduled twice
    sched.send(second)
    assert not sched.schedule()                          # everything is in flight
    sched.land(second)
    _advance(sched, second)
    sched.send(_only(seqs[2]))                           # seq 2 decoding in flight
    sched.land(first)
    _advance(sched, first)
    # 3 blocks used, 3 free; seqs 0 and 1 need a second block each, seq 2 (in flight, youngest) must not go
    sched.kv.allocate(2)                                 # leave one free block
    third = sched.schedule()
    assert [s.seq for s in third] == [seqs[0]]           # seq 1 preempted (youngest not in flight), not seq 2
    assert seqs[1].status is SeqStatus.WAITING and seqs[2].status is SeqStatus.RUNNING


def _only(seq, num_new=1):
    return SchedulerOutput([ScheduledSeq(seq, num_new, seq.num_computed_tokens)])


def test_a_prompts_next_chunk_rides_in_the_batch_behind_its_previous_one():
    """A chunk in flight that does not sample leaves nothing the next chunk needs: the next batch takes it, from the
    offset after every chunk in flight, with its blocks; the chunk that reaches the prompt's end samples, and the
    decode after it waits for its token. A request that records prompt log-probabilities waits (they are taken in
    chunk order), and a chunk ahead of its predecessor never preempts anything."""
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4)
    sched = Scheduler(config, KVManager(16, 4))
    long = _seq(0, 25)
    sched.add(long)
    chunks = []
    for _ in range(3):
        batch = sched.schedule(budget=10)
        chunks.append(batch)
        sched.send(batch)
    assert [(s.start, s.num_new_tokens) for b in chunks for s in b] == [(0, 10), (10, 10), (20, 5)]
    assert [b.sampling_seqs for b in chunks] == [[], [], [long]]
    assert len(long.block_ids) == 7 and long.num_computed_tokens == 0
    assert not sched.schedule(budget=10)                # its last chunk samples: the decode waits for the token
    for batch in chunks:                                 # the outputs come in order
        sched.land(batch)
        _advance(sched, batch)
    assert long.num_computed_tokens == 25 and long.token_ids[-1] == 7 and not sched.in_flight

    logprobs = Sequence(1, "r1", 0, list(range(25)), 25, SamplingParams(max_tokens=4, prompt_logprobs=1), 0.0)
    sched.add(logprobs)
    batch = sched.schedule(budget=10)
    assert [(s.seq, s.start) for s in batch] == [(long, 25), (logprobs, 0)]
    sched.send(batch)
    assert not sched.schedule(budget=10)                # long decodes in flight, logprobs records in order

    full = Scheduler(config, KVManager(3, 4))
    prompt, short = _seq(2, 20), _seq(3, 2)
    full.add(prompt), full.add(short)
    ahead = full.schedule(budget=8)                      # the prompt's first 8 tokens: 2 of the 3 blocks
    full.send(ahead)
    batch = full.schedule(budget=8)                      # its next chunk needs 2 blocks, 1 is free: `short` runs
    assert [(s.seq, s.start) for s in batch] == [(short, 0)]
    _advance(full, batch)
    batch = full.schedule(budget=8)                      # no block free: nothing is preempted for the next chunk
    assert [s.seq for s in batch] == [short] and full.num_preemptions == 0
    assert short.status is SeqStatus.RUNNING and len(prompt.block_ids) == 2
