"""Runtime reshaping (TP layout changes) as a transaction on 2 worker processes (3 KV heads: TP2 splits them 2 + 1):
requests decoding across [1,1] -> [2] -> [1,1] produce the tokens of an untransformed run without any re-prefill;
scale-up gives back the freed shard pages (ledger and RSS) and scale-down takes them again; a failure before the
commit point leaves the old topology serving every request."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.config import EngineConfig
from elastic_hf.engine.routing import TPPolicy
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from elastic_hf.parallel.reshape import ReshapeAborted
from elastic_hf.parallel.worker_reshape import RESHAPE_STAGES
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 24


@pytest.fixture(scope="module")
def setup(tp_checkpoint):
    path = tp_checkpoint("kv3")
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 6, 3, 90, seed=21)
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    # A 48-token step budget keeps some prompts mid-prefill (chunked) when a reshape starts.
    # 1 MiB of KV per worker: 51 blocks of 16 tokens, so an 880-token request is "long" for a TP1 instance.
    # No prefix cache: the tests count prefilled prompt tokens to prove that reshapes recompute nothing, and they
    # reuse the same prompts (tests/parallel/test_prefix_cache_elastic.py covers the cache across reshapes).
    model = ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=1 << 20, max_num_batched_tokens=48,
                                         enable_prefix_caching=False)
    yield model.deployment, prompts, expected, reference
    model.close()


def _submit(dep, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [dep.add_request(None, p, params) for p in prompts]


def _generate(dep, prompts):
    ids = _submit(dep, prompts)
    done = run_steps(dep, ids, {})
    return [done[r] for r in ids]


def _by_worker(dep, key):
    return [r[key] for r in dep.memory_report()]


def test_idle_reshape_to_tp2_matches_hf(setup):
    dep, prompts, expected, _ = setup
    dep.reshape([2])
    try:
        assert _generate(dep, prompts[:4]) == expected[:4]
    finally:
        dep.reshape([1, 1])


def test_decoding_across_scale_up_and_down_is_exact_without_recompute(setup):
    dep, prompts, expected, _ = setup
    assert str(dep.topology) == "[1,1]"
    prompt_tokens_before = dep.stats()["num_computed_prompt_tokens"]
    ids = _submit(dep, prompts)
    done = run_steps(dep, ids, {}, num_steps=3)
    running = sum(len(i.engine.scheduler.running) for i in dep.instances)
    assert running >= 4 and not done
    weights_tp1 = _by_worker(dep, "weights_bytes")
    rss_tp1 = _by_worker(dep, "rss_anon_bytes")

    up = dep.reshape([2])
    assert up.committed and up.num_moved_seqs == len(prompts) and [i.tp for i in dep.instances] == [2]
    weights_tp2 = _by_worker(dep, "weights_bytes")
    rss_tp2 = _by_worker(dep, "rss_anon_bytes")
    for w, stats in enumerate(up.worker_stats):
        released = stats["weights_first"][1] + stats["weights_last"][1]
        assert stats["weights_first"][0] == stats["weights_last"][0] == 0  # scale-up copies no weight
        assert released > 0 and weights_tp1[w] - weights_tp2[w] == released
        # The freed pages really left the process (KV pages touched meanwhile are far smaller).
        assert rss_tp1[w] - rss_tp2[w] > released // 2, (rss_tp1, rss_tp2, released)
        assert stats["kv"]["sent_bytes"] > 0 and stats["kv"]["received_bytes"] > 0
        assert stats["kv"]["peak_extra_bytes"] > 0

    run_steps(dep, ids, done, num_steps=4)
    down = dep.reshape([1, 1])
    assert down.committed and [i.tp for i in dep.instances] == [1, 1]
    assert _by_worker(dep, "weights_bytes") == weights_tp1  # every shard page is back
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected
    stats = dep.stats()
    assert stats["num_preemptions"] == 0
    # Exactly one prefill per prompt token: no request was recomputed across the two reshapes.
    assert stats["num_computed_prompt_tokens"] - prompt_tokens_before == sum(len(p) for p in prompts)
    text = dep.metrics.render().decode()
    assert 'elastic_hf_instances{pp="1",tp="1"} 2.0' in text and "elastic_hf_reshape_seconds_count" in text


@pytest.mark.stress
@pytest.mark.parametrize("stage", RESHAPE_STAGES)
def test_failure_before_commit_rolls_back(setup, stage):
    dep, prompts, expected, _ = setup
    assert str(dep.topology) == "[1,1]"
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=5)
    before = dep.memory_report()
    dep.pool.call(1, "reshape.arm_fault", stage)
    with pytest.raises(ReshapeAborted, match=stage):
        dep.reshape([2])
    assert str(dep.topology) == "[1,1]" and not dep.reshapes[-1].committed
    after = dep.memory_report()
    for b, a in zip(before, after):
        assert (a["weights_bytes"], a["kv_bytes"], a["kv_blocks"]) == (b["weights_bytes"], b["kv_bytes"],
                                                                      b["kv_blocks"])
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]


@pytest.mark.stress
def test_worker_killed_before_commit_is_replaced_and_old_topology_serves(setup):
    dep, prompts, expected, _ = setup
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=5)
    old_pid = dep.pool.call(1, "ping")
    dep.pool.call(1, "reshape.arm_fault", "kv_migrate", True)
    with pytest.raises(ReshapeAborted, match="died"):
        dep.reshape([2])
    assert str(dep.topology) == "[1,1]" and dep.pool.call(1, "ping") != old_pid
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]  # worker 1's requests were recomputed, none was lost


@pytest.mark.stress
def test_worker_killed_after_commit_is_replaced_with_its_shard(setup):
    dep, prompts, expected, _ = setup
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=5)
    dep.pool.call(1, "reshape.arm_fault", "committed", True)
    recoveries = dep.num_recoveries
    dep.reshape([2])  # worker 1 dies right after its commit: the new topology stands, worker 1 is replaced
    assert str(dep.topology) == "[2]" and dep.num_recoveries == recoveries + 1
    report = dep.memory_report()[1]
    assert report["topology"] == "[2]" and report["weights_bytes"] == dep.pool.call(1, "shard_bytes", 2, 1)
    assert report["weights_bytes"] < dep.pool.call(1, "shard_bytes", 1, 0)  # only its shard came back
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]
    dep.reshape([1, 1])


@pytest.mark.stress
def test_a_live_worker_failing_its_commit_is_replaced_so_all_agree_on_the_new_layout(setup):
    """A non-fatal error after the commit point used to be re-raised with worker 1 possibly on another layout
    than worker 0; now the failing worker is ended and replaced under the new topology."""
    dep, prompts, expected, _ = setup
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=5)
    old_pid = dep.pool.call(1, "ping")
    dep.pool.call(1, "reshape.arm_fault", "committed", False)   # raise, do not die
    recoveries = dep.num_recoveries
    report = dep.reshape([2])
    assert report.committed and str(dep.topology) == "[2]" and dep.num_recoveries == recoveries + 1
    assert dep.pool.call(1, "ping") != old_pid
    assert [r["topology"] for r in dep.memory_report()] == ["[2]", "[2]"]
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]
    dep.reshape([1, 1])


def test_elastic_policy_merges_for_a_long_request_and_splits_back(setup):
    dep, prompts, expected, reference = setup
    assert str(dep.topology) == "[1,1]"
    long_prompt = mixed_prompts(dep.tokenizer, 1, 880, 880, seed=22)[0]
    assert -(-(880 + MAX_NEW) // 16) > dep.tp1_blocks  # does not fit one TP1 worker's KV cache
    static_policy = dep.policy
    dep.policy = TPPolicy(EngineConfig(tp_policy="elastic", router="elastic"), dep.degrees)
    try:
        first = _submit(dep, prompts[:2])
        done = run_steps(dep, first, {}, num_steps=2)
        num_reshapes = len(dep.reshapes)
        long_id = _submit(dep, [long_prompt])[0]  # no instance holds it: merge [1,1] -> [2] first
        assert str(dep.topology) == "[2]" and len(dep.reshapes) == num_reshapes + 1
        later = _submit(dep, prompts[2:4])        # short requests keep arriving and are served on the TP2 instance
        ids = first + later + [long_id]
        served_while_long_ran = set()
        while len(done) < len(ids):
            for out in dep.step():
                if long_id not in done and out.request_id != long_id:
                    served_while_long_ran.add(out.request_id)
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert set(first + later) <= served_while_long_ran
        assert [done[r] for r in first + later] == expected[:4]
        assert done[long_id] == hf_greedy(reference, long_prompt, MAX_NEW)
        assert str(dep.topology) == "[1,1]"  # split back once the long request was gone
        assert [(r.old, r.new) for r in dep.reshapes[num_reshapes:]] == [("[1,1]", "[2]"), ("[2]", "[1,1]")]
    finally:
        dep.policy = static_policy
        if str(dep.topology) != "[1,1]":
            dep.reshape([1, 1])


def test_scale_down_gathers_weight_chunks_from_peers(setup):
    dep, prompts, expected, _ = setup
    dep.reshape([2])
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=6)
    down = dep.reshape([1, 1], weights_source="peers")
    for w, stats in enumerate(down.worker_stats):
        assert stats["gather"]["gathered_bytes"] > 0 and stats["gather"]["sent_bytes"] > 0
        assert stats["weights_last"][0] == 0  # nothing read from the host store
    assert [r["weights_bytes"] for r in dep.memory_report()] == [dep.pool.call(w, "shard_bytes", 1, 0) for w in (0, 1)]
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]
    with pytest.raises(ValueError, match="weights_source"):
        dep.reshape([2], weights_source="disk")
    assert str(dep.topology) == "[1,1]"


def test_standby_and_wake_up_keep_requests_exact(setup):
    dep, prompts, expected, _ = setup
    assert str(dep.topology) == "[1,1]"
    prompt_tokens_before = dep.stats()["num_computed_prompt_tokens"]
    ids = _submit(dep, prompts[:3])
    done = run_steps(dep, ids, {}, num_steps=4)
    pid = dep.pool.call(1, "ping")
    down = dep.reshape([1])  # worker 1 hands its requests' KV to worker 0's pool and goes to standby
    assert down.committed and [i.workers for i in dep.instances] == [(0,)]
    standby = dep.memory_report()[1]
    assert standby["kv_blocks"] == 0 and standby["kv_bytes"] == 0
    assert standby["weights_bytes"] == dep.pool.call(1, "info")["replicated_weights_bytes"]  # its shard went back
    run_steps(dep, ids, done, num_steps=3)
    up = dep.reshape([2])    # wake-up in the same process: shard from the host store, KV by head range
    assert up.committed and dep.pool.call(1, "ping") == pid
    run_steps(dep, ids, done, num_steps=3)
    dep.reshape([1, 1])
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:3]
    assert dep.stats()["num_computed_prompt_tokens"] - prompt_tokens_before == sum(len(p) for p in prompts[:3])


def test_async_engine_serves_a_deployment_across_a_reshape(setup):
    """The server's AsyncEngine drives the deployment itself (it is an engine); an admin-style reshape runs on the
    engine thread between steps while streams are open."""
    import asyncio

    from elastic_hf.engine.async_engine import AsyncEngine

    dep, prompts, expected, _ = setup
    engine = dep
    async_engine = AsyncEngine(engine).start()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)

    async def collect(stream):
        tokens = []
        async for out in stream:
            tokens = out.outputs[0].token_ids
        return tokens

    async def main():
        streams = await async_engine.add_requests(prompts[:4], params)
        tasks = [asyncio.create_task(collect(s)) for s in streams]
        await asyncio.sleep(0.05)
        up = await async_engine.call(engine.reshape, [2])
        down = await async_engine.call(engine.reshape, [1, 1])
        return await asyncio.gather(*tasks), up, down

    try:
        outputs, up, down = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert outputs == expected[:4] and up.committed and down.committed
    assert engine.stats()["kv_blocks_used"] == 0
    assert b"elastic_hf_reshapes_total" in async_engine.metrics.render()


def test_bad_reshape_and_routing_input_is_refused_cleanly(setup):
    dep, prompts, _, _ = setup
    with pytest.raises(ValueError, match="not a candidate"):
        dep.reshape([3])
    with pytest.raises(ValueError, match=r"instance must be in \[0, 2\)"):
        dep.add_request(None, prompts[0], instance=5)
    rid = dep.add_request(None, prompts[0], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        dep.add_request(rid, prompts[1])
    dep.abort_request(rid)
    dep.abort_request(rid)  # idempotent
    assert not dep.has_unfinished_requests() and str(dep.topology) == "[1,1]"


def test_a_request_that_will_be_refused_never_reshapes(setup):
    """Validation comes before routing (engine/input_processor.py): a long request with a token id out of the
    vocabulary, or one whose max_tokens overflow max_model_len, would make the elastic policy merge [1,1] -> [2]
    if it were routed first; it gets its 400 and the deployment does not move."""
    dep, _, _, _ = setup
    static_policy = dep.policy
    dep.policy = TPPolicy(EngineConfig(tp_policy="elastic", router="elastic"), dep.degrees)
    try:
        long_prompt = mixed_prompts(dep.tokenizer, 1, 880, 880, seed=22)[0]
        num_reshapes = len(dep.reshapes)
        with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, "):
            dep.add_request(None, long_prompt[:-1] + [dep.hf_config.vocab_size], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            dep.add_request(None, long_prompt, SamplingParams(max_tokens=dep.max_model_len))
        assert str(dep.topology) == "[1,1]" and len(dep.reshapes) == num_reshapes
        assert not dep.has_unfinished_requests()
    finally:
        dep.policy = static_policy
