"""Prefix caching on the control plane (torch-free): what a prompt finds, what registering and freeing leave cached,
eviction order, epochs, and a property test of the allocator with random allocate / free / lookup / take / evict
sequences against a model: a block with a holder is never handed out again or evicted, and the counts add up."""
import random

import pytest

from elastic_hf.config import EngineConfig
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.engine.scheduler import Scheduler
from elastic_hf.engine.sequence import Sequence
from elastic_hf.engine.step_plan import ModelRunnerOutput
from elastic_hf.kv.kv_manager import KVManager
from elastic_hf.kv.prefix_cache import PrefixCache, hash_function

BS = 4


def _sched(num_blocks=32, budget=64, algo="sha256"):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=budget, block_size=BS)
    return Scheduler(config, KVManager(num_blocks, BS, prefix_cache=PrefixCache(algo)))


_ids = iter(range(10_000))


def _seq(tokens, salt=None, **params):
    return Sequence(next(_ids), "r", 0, list(tokens), len(tokens),
                    SamplingParams(max_tokens=8, cache_salt=salt, **params), 0.0)


def _run_prompt(sched, seq):
    """Admit `seq` and run steps until its prompt is computed (one token sampled); returns the tokens it found."""
    sched.add(seq)
    for _ in range(100):
        if seq.num_output_tokens:
            break
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput([99] * len(out.sampling_seqs)))
    else:
        raise AssertionError(f"sequence {seq.seq_id} was not admitted in 100 steps")
    return seq.num_cached_tokens


def test_a_second_prompt_finds_the_full_blocks_of_the_first_but_never_its_last_token():
    sched = _sched()
    system = list(range(100, 113))                 # 13 tokens: 3 full blocks
    first = _seq(system + [1, 2, 3])               # 16 tokens: blocks 0-3 full once computed
    assert _run_prompt(sched, first) == 0
    sched.finish(first, "stop")
    assert sched.kv.num_used == 0 and sched.kv.num_cached_free == 4   # the computed blocks stay cached
    second = _seq(system + [7, 8])
    assert _run_prompt(sched, second) == 12        # blocks 0-2; block 3 differs
    again = _seq(system + [1, 2, 3])               # the same 16 tokens: the last one is recomputed for its logits
    assert _run_prompt(sched, again) == 12
    cache = sched.kv.prefix_cache
    assert cache.num_hit_tokens == 24 and cache.num_queried_tokens == 16 + 15 + 16


def test_running_sequences_share_blocks_and_a_freed_block_stays_until_evicted():
    sched = _sched(num_blocks=6)
    a = _seq(range(9))
    _run_prompt(sched, a)                          # blocks of tokens 0-3, 4-7 named; a holds 3 blocks
    b = _seq(range(9))
    assert _run_prompt(sched, b) == 8
    assert b.block_ids[:2] == a.block_ids[:2] and sched.kv.ref_count(a.block_ids[0]) == 2
    sched.finish(a, "stop")
    assert sched.kv.ref_count(b.block_ids[0]) == 1 and sched.kv.num_cached_free == 0
    sched.finish(b, "stop")
    assert sched.kv.num_cached_free == 2 and sched.kv.num_free == 6
    # A prompt that needs every block evicts the cached ones last, and they are gone afterwards.
    big = _seq(range(500, 521))
    _run_prompt(sched, big)
    assert sched.kv.num_cached_free == 0 and len(sched.kv.prefix_cache) == 5
    sched.finish(big, "stop")
    assert _run_prompt(sched, _seq(range(9))) == 0


def test_preempted_sequence_finds_its_own_blocks_on_readmission():
    sched = _sched(num_blocks=5, budget=64)
    old, young = _seq(range(8)), _seq(range(40, 48))
    sched.add(old), sched.add(young)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput([7] * len(out.sampling_seqs)))
    while young.num_preemptions == 0:              # old grows until young is preempted
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput([7] * len(out.sampling_seqs)))
    sched.finish(old, "stop")
    out = sched.schedule()                         # young comes back: its two full blocks were kept
    assert young.num_computed_tokens == 8 and [s.num_new_tokens for s in out if s.seq is young] == [1]


def test_salts_and_epochs_separate_what_can_be_found():
    sched = _sched()
    _run_prompt(sched, _seq(range(9), salt="tenant-a"))
    assert _run_prompt(sched, _seq(range(9), salt="tenant-b")) == 0
    assert _run_prompt(sched, _seq(range(9), salt="tenant-a")) == 8
    running = _seq(range(50, 59))
    _run_prompt(sched, running)
    assert sched.kv.reset_prefix_cache() > 0       # a morph changed the weights
    assert len(sched.kv.prefix_cache) == 0 and sched.kv.num_cached_free == 0
    for _ in range(8):                             # running registers nothing more in the new epoch
        out = sched.schedule()
        sched.update_from_output(out, ModelRunnerOutput([7] * len(out.sampling_seqs)))
    assert len(sched.kv.prefix_cache) == 0
    assert _run_prompt(sched, _seq(range(9), salt="tenant-a")) == 0


def test_prompt_logprobs_requests_compute_every_position_but_still_register():
    sched = _sched()
    _run_prompt(sched, _seq(range(9)))
    wants_logits = _seq(range(9), prompt_logprobs=1)
    assert _run_prompt(sched, wants_logits) == 0 and wants_logits.num_computed_tokens == 9
    assert _run_prompt(sched, _seq(range(20, 29), prompt_logprobs=1)) == 0
    assert _run_prompt(sched, _seq(range(20, 29))) == 8


def test_admission_without_room_gives_the_prefix_back():
    sched = _sched(num_blocks=4, budget=64)
    holder = _seq(range(9))
    _run_prompt(sched, holder)                     # 3 blocks held, 1 free
    waiting = _seq(list(range(8)) + list(range(60, 70)))   # 2 cached blocks + needs 3 more: does not fit
    sched.add(waiting)
    sched.schedule()
    assert waiting in sched.waiting and waiting.block_ids == [] and waiting.num_computed_tokens == 0
    assert sched.kv.ref_count(holder.block_ids[0]) == 1


@pytest.mark.parametrize("algo", ["sha256", "builtin"])
def test_hashes_chain_over_the_whole_prefix(algo):
    h = hash_function(algo)
    a = h(None, [1, 2, 3, 4], b"0\x00")
    assert h(None, [1, 2, 3, 4], b"0\x00") == a and h(None, [1, 2, 3, 4], b"1\x00") != a
    assert h(a, [5, 6, 7, 8], b"") != h(h(None, [9, 2, 3, 4], b"0\x00"), [5, 6, 7, 8], b"")
    with pytest.raises(ValueError, match="prefix_caching_hash_algo must be one of"):
        hash_function("md5")


def test_random_operations_never_hand_out_a_held_block():
    """Random allocate / free / register / lookup+take / shrink / epoch sequences against a model of the holders."""
    rng = random.Random(7)
    kv = KVManager(24, BS, pools=lambda resize: [[]], prefix_cache=PrefixCache("builtin"))
    holders: dict[int, int] = {}                   # block -> holders, by the model
    named: dict[int, int] = {}                     # hash -> block, by the model (what may still be found)
    sequences: list[list[int]] = []
    next_hash = iter(range(10**6))
    for _ in range(3000):
        op = rng.random()
        if op < 0.3 and kv.num_free:
            blocks = kv.allocate(rng.randint(1, min(4, kv.num_free)))
            assert not any(holders.get(b) for b in blocks), "a held block was handed out again"
            named = {h: b for h, b in named.items() if b not in blocks}   # taken blocks are evicted
            for b in blocks:
                holders[b] = 1
            sequences.append(blocks)
        elif op < 0.55 and sequences:
            blocks = sequences.pop(rng.randrange(len(sequences)))
            kv.free(blocks)
            for b in blocks:
                holders[b] -= 1
        elif op < 0.7 and sequences:
            block = rng.choice(rng.choice(sequences))
            h = next(next_hash)
            if block not in named.values():
                kv.cache_block(block, h)
                named[h] = block
        elif op < 0.9 and named:
            h = rng.choice(list(named))
            found = kv.lookup_prefix([h])
            assert found == [named[h]]
            kv.take_cached(found)
            holders[found[0]] = holders.get(found[0], 0) + 1
            sequences.append(found)
        elif op < 0.95:
            gone = kv.shrink(rng.randint(0, 2))
            assert not any(holders.get(b) for b in gone), "a held block was detached"
            named = {h: b for h, b in named.items() if b not in gone}
        else:
            kv.reset_prefix_cache()
            named = {}
        in_use = sum(1 for n in holders.values() if n)
        assert kv.num_used == in_use
        assert kv.num_cached_free == sum(1 for b in named.values() if not holders.get(b))
        assert kv.num_free + kv.num_used == kv.num_total


def test_n2_siblings_share_the_prompt_blocks_the_first_one_computes():
    sched = _sched(budget=8)                       # 8-token chunks: the 21-token prompt takes three steps
    params = SamplingParams(max_tokens=8, n=2)
    first, second = (Sequence(next(_ids), "req-n2", i, list(range(21)), 21, params, 0.0) for i in range(2))
    sched.add(first), sched.add(second)
    steps = 0
    while second.num_output_tokens == 0:
        out = sched.schedule()
        if first.num_computed_tokens < 21:
            assert second not in [s.seq for s in out]   # waits while its sibling computes their prompt
        sched.update_from_output(out, ModelRunnerOutput([5] * len(out.sampling_seqs)))
        steps += 1
        assert steps < 20
    assert second.num_cached_tokens == 20 and second.block_ids[:5] == first.block_ids[:5]
