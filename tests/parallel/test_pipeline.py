"""Pipeline parallelism: a 1x2 instance (two stages on two worker processes) gives the greedy tokens of HF
`generate`, with even and uneven layer splits, chunked prefill, preemption; a stage holds only its own layers'
weights and KV (ledger); a stage that fails fails the step everywhere at once and the instance serves on."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from elastic_hf.parallel.reshape import ReshapeAborted
import fault_injection
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def pp_checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("pp-models")
    # 5 layers: an even split is 3/2 (the LM head stage holds fewer); wide MLP so a layer's pages show in RSS.
    return lambda arch="llama", intermediate_size=1024, tied=False: build_tiny_checkpoint(
        arch, root / f"{arch}-{intermediate_size}-{tied}", 0, num_hidden_layers=5,
        intermediate_size=intermediate_size, tie_word_embeddings=tied)


@pytest.mark.parametrize("arch,topology", [("llama", "1x2"), ("qwen2", "1x2:1/4"), ("mistral", "1x2:4/1")])
def test_pp2_matches_hf_with_chunked_prefill(pp_checkpoint, arch, topology):
    path = pp_checkpoint(arch)
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 6, 3, 70, seed=21)
    with ElasticModel.from_pretrained(path, workers=2, topology=topology, kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=48) as model:  # chunked prefill shares steps
        assert str(model.topology) == f"[{topology}]"
        outputs = model.generate(prompts, max_tokens=MAX_NEW)
        assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
        workers = model.memory_report()["workers"]
        bounds = [w["layers"] for w in workers]
        split = [int(n) for n in topology.split(":")[1].split("/")] if ":" in topology else [3, 2]
        assert bounds == [(0, split[0]), (split[0], 5)]
        # Each stage commits only its own layers' weights: beside the vocabulary tables, the difference is whole
        # layers. The first stage holds no table (it embeds from the host store's rows), the last the head.
        layer_bytes = [w["weights_bytes"] - w["table_bytes"] for w in workers]
        per_layer = (layer_bytes[0] - layer_bytes[1]) / (split[0] - split[1]) if split[0] != split[1] else None
        if per_layer is not None:
            assert per_layer > 3 * 64 * 1024 * 4  # at least the MLP of a layer (3 x hidden x intermediate fp32)
        head = 49152 * 64 * 4
        assert [w["table_bytes"] for w in workers] == [0, head] and [w["host_embedding_rows"] for w in workers] \
            == [True, False]


def test_pp2_preempts_and_recomputes_exactly(pp_checkpoint):
    path = pp_checkpoint("llama", intermediate_size=128, tied=True)
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 14, 60, 120, seed=22)
    # A KV cache too small for all of them at once (a stage's budget is the whole model's weights + 24 KiB; what
    # the last stage does not hold, 3 layers, ~58 blocks of its 2, is its KV; the first stage also gives back the
    # tied table): the scheduler preempts and recomputes.
    with ElasticModel.from_pretrained(path, workers=2, topology="1x2", kv_cache_memory=24 << 10,
                                      max_num_batched_tokens=64) as model:
        dep = model.deployment
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        ids = [dep.add_request(None, p, params) for p in prompts]
        done = run_steps(dep, ids, {})
        assert [done[r] for r in ids] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
        assert dep.stats()["num_preemptions"] > 0
        text = dep.metrics.render().decode()
        assert 'elastic_hf_instances{pp="2",tp="1"} 1.0' in text
        assert "elastic_hf_pipeline_bubble_ratio{" in text
        # Where each stage's time went: forwards, the gap before its steps, waiting for upstream, its sends.
        parts = dep.deployment_metrics.pipeline_stage_s
        assert sorted(parts) == [0, 1]
        for p in parts.values():
            assert 0 < p["busy_s"] and p["busy_s"] + p["gap_s"] + p["recv_s"] + p["flush_s"] <= p["wall_s"] * 1.0001
        assert parts[0]["recv_s"] == 0 and parts[1]["recv_s"] > 0   # only stage 1 has an upstream
        assert parts[1]["flush_s"] == 0                              # the last stage sends nothing on


@pytest.fixture(scope="module")
def pp_setup(pp_checkpoint):
    path = pp_checkpoint("llama")
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 6, 3, 90, seed=23)
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    # A 48-token step budget keeps some prompts mid-prefill (chunked) when a reshape starts. No prefix cache: the
    # tests reuse the prompts and count prefilled tokens to prove that reshapes recompute nothing.
    model = ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=1 << 20, max_num_batched_tokens=48,
                                         worker_extension_cls=fault_injection.EXTENSION, enable_prefix_caching=False)
    yield model.deployment, prompts, expected
    model.close()


def _submit(dep, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return [dep.add_request(None, p, params) for p in prompts]


def test_decoding_across_tp_and_pp_reshapes_is_exact_without_recompute(pp_setup):
    """[1,1] -> 1x2 -> [2] -> 1x2:4/1 -> [1,1] while requests decode: the tokens of an untouched run, no prompt
    token computed twice, every byte the plan moves accounted for, peak extra memory within one layer's KV."""
    dep, prompts, expected = pp_setup
    assert str(dep.topology) == "[1,1]"
    prompt_tokens_before = dep.stats()["num_computed_prompt_tokens"]
    ids = _submit(dep, prompts)
    done = run_steps(dep, ids, {}, num_steps=3)
    assert not done
    weights_before = [w["weights_bytes"] for w in dep.memory_report()]
    for target in (["1x2"], [2], ["1x2:4/1"], [1, 1]):
        report = dep.reshape(target)
        assert report.committed and str(dep.topology) == str(dep.check_topology(target))
        kv = [s["kv"] for s in report.worker_stats if s.get("kv")]
        assert sum(k["sent_bytes"] for k in kv) == report.kv_plan_bytes["sent"] > 0
        assert sum(k["received_bytes"] for k in kv) == report.kv_plan_bytes["sent"]
        assert sum(k["local_bytes"] for k in kv) == report.kv_plan_bytes["local"]
        for k in kv:   # staging holds at most one layer's share of the moved blocks
            layer_share = report.kv_plan_bytes["sent"] / 5 if report.kv_plan_bytes["sent"] else 0
            assert k["peak_staging_bytes"] <= 2 * layer_share + 1
        run_steps(dep, ids, done, num_steps=2)
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected
    assert dep.stats()["num_computed_prompt_tokens"] - prompt_tokens_before == sum(len(p) for p in prompts)
    assert [w["weights_bytes"] for w in dep.memory_report()] == weights_before


SAMPLED = [SamplingParams(temperature=0.9, seed=7, max_tokens=MAX_NEW),
           SamplingParams(temperature=1.0, top_p=0.8, top_k=50, seed=8, n=2, max_tokens=MAX_NEW),
           SamplingParams(temperature=0.7, repetition_penalty=1.4, seed=9, max_tokens=MAX_NEW),
           SamplingParams(temperature=0.0, max_tokens=MAX_NEW)]


def _sampled_tokens(dep, prompts):
    """Every sequence's tokens of SAMPLED[i % 4] on prompts[i], all submitted at once, stepped to the end."""
    ids = [dep.add_request(None, p, SAMPLED[i % len(SAMPLED)]) for i, p in enumerate(prompts)]
    done = {}
    while len(done) < len(ids):
        for out in dep.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
    return [done[r] for r in ids]


def test_workers_sample_and_return_token_ids(pp_setup, pp_checkpoint):
    """Seeded sampling (temperature, top-p/top-k with n=2, a repetition penalty, greedy) in a 2-worker deployment,
    as [1,1] and as a 1x2 pipeline, gives the tokens of a single-worker model, with the engine's logits path
    disabled: the workers sample and only token ids come back. A logprobs request still gets logits."""
    dep, prompts, _ = pp_setup
    with ElasticModel.from_pretrained(pp_checkpoint("llama"), kv_cache_memory=1 << 20) as single:
        want = _sampled_tokens(single.deployment, prompts)
    assert len({str(t) for t in want}) > 2   # the rows really sample differently
    for target in ([1, 1], ["1x2"]):
        if str(dep.topology) != str(dep.check_topology(target)):
            assert dep.reshape(target).committed
        runners = [instance.runner for instance in dep.instances]
        for runner in runners:
            runner.execute = _no_logits
        try:
            assert _sampled_tokens(dep, prompts) == want, f"topology {dep.topology}"
        finally:
            for runner in runners:
                del runner.execute
        ids = [dep.add_request(None, prompts[0], SamplingParams(temperature=0.0, max_tokens=3, logprobs=2))]
        done = {}
        while not done:
            for out in dep.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0]
        assert len(done[ids[0]].logprobs) == 3 and all(len(r.top) == 2 for r in done[ids[0]].logprobs)
    assert dep.reshape([1, 1]).committed


def _no_logits(inputs):
    raise AssertionError("the engine asked a worker for logits in a step with no log-probabilities")


def test_pp_stage_holds_only_its_layers(pp_setup):
    dep, prompts, expected = pp_setup
    full = [w["weights_bytes"] for w in dep.memory_report()]
    rss_full = [w["rss_anon_bytes"] for w in dep.memory_report()]
    report = dep.reshape(["1x2:4/1"])
    try:
        workers = dep.memory_report()
        table = 49152 * 64 * 4   # the untied embedding and head: [vocab, hidden] fp32 each
        per_layer = (full[1] - workers[1]["weights_bytes"] - table) / 4   # stage 1: layers 0-3 and the embedding
        assert per_layer > 3 * 64 * 1024 * 4                              # at least one layer's MLP
        # stage 0: layer 4, and both tables (it embeds from the host store's rows and runs no head)
        assert full[0] - workers[0]["weights_bytes"] - 2 * table == pytest.approx(per_layer, rel=0.01)
        assert [w["table_bytes"] for w in workers] == [0, table]
        assert report.worker_stats[1]["layers_released_bytes"] == pytest.approx(4 * per_layer + table, rel=0.01)
        assert rss_full[1] - workers[1]["rss_anon_bytes"] > 2 * per_layer   # the pages left the process
        # Each stage's KV blocks hold only its layers: stage 1's blocks are a quarter of stage 0's.
        assert workers[0]["kv_block_bytes"] >= 3 * workers[1]["kv_block_bytes"]
        ids = _submit(dep, prompts[:3])
        done = run_steps(dep, ids, {})
        assert [done[r] for r in ids] == expected[:3]
    finally:
        dep.reshape([1, 1])


@pytest.mark.stress
@pytest.mark.parametrize("stage", ["weights_first", "kv_migrate", "weights_last", "prepared"])
def test_fault_before_commit_rolls_a_pp_reshape_back(pp_setup, stage):
    dep, prompts, expected = pp_setup
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=3)
    dep.pool.call(1, "reshape.arm_fault", stage)
    with pytest.raises(ReshapeAborted):
        dep.reshape(["1x2"])
    assert str(dep.topology) == "[1,1]"
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]


def test_micro_batches_are_contiguous_and_balanced():
    from types import SimpleNamespace

    from elastic_hf.parallel.instance_runner import split_micro_batches

    seqs = [SimpleNamespace(token_ids=[0] * n) for n in (40, 1, 1, 1, 1, 30, 1, 1)]
    groups = split_micro_batches(seqs, 2)
    assert [s for g in groups for s in g] == seqs and len(groups) == 2
    assert sum(len(s.token_ids) for s in groups[0]) >= 38
    assert split_micro_batches(seqs[:1], 4) == [seqs[:1]]
    assert [len(g) for g in split_micro_batches(seqs[:3], 4)] == [1, 1, 1]


@pytest.mark.stress
def test_worker_killed_after_a_pp_commit_is_replaced(pp_setup):
    dep, prompts, expected = pp_setup
    ids = _submit(dep, prompts[:4])
    done = run_steps(dep, ids, {}, num_steps=3)
    pids = dep.pool.pids()
    dep.pool.call(1, "reshape.arm_fault", "committed", True)   # worker 1 dies right after the commit point
    report = dep.reshape(["1x2"])
    assert report.committed and str(dep.topology) == "[1x2]" and dep.num_recoveries >= 1
    assert dep.pool.pids()[0] == pids[0] and dep.pool.pids()[1] != pids[1]
    assert [w["layers"] for w in dep.memory_report()] == [(0, 3), (3, 5)]   # the replacement holds stage 1
    run_steps(dep, ids, done)
    assert [done[r] for r in ids] == expected[:4]   # its requests were recomputed, none lost
    dep.reshape([1, 1])


def test_reshape_to_less_kv_preempts_and_reports(pp_checkpoint):
    """A 1x2 pipeline holds more KV than two TP1 instances (each stage commits only its layers): a reshape to
    [1,1] under load preempts the youngest requests by recompute, names them, and every request still gets its
    exact tokens; without allow_preemption the same reshape is refused and nothing changes."""
    path = pp_checkpoint("llama", intermediate_size=128)
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 8, 40, 60, seed=24)
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    with ElasticModel.from_pretrained(path, workers=2, topology="1x2", kv_cache_memory=200 << 10,
                                      max_num_batched_tokens=512) as model:
        dep = model.deployment
        for attempt in ("refused", "preempting"):
            ids = _submit(dep, prompts)
            done = run_steps(dep, ids, {}, num_steps=2)
            held = sum(len(s.block_ids) for i in dep.instances for s in i.engine.scheduler.running)
            capacity = sum(dep.capacity(key) for key in dep.check_topology([1, 1]).instance_keys())
            assert held > capacity, (held, capacity)   # the split layout cannot keep every request's KV
            if attempt == "refused":
                with pytest.raises(ValueError, match="no new instance has that many free"):
                    dep.reshape([1, 1])                 # the policy's own reshapes never preempt
                assert str(dep.topology) == "[1x2]"
            else:
                report = model.reshape([1, 1])
                assert report.committed and report.preempted and set(report.preempted) <= set(ids)
                assert report.preempted == [r for r in ids if r in report.preempted][-len(report.preempted):]
            run_steps(dep, ids, done)
            assert [done[r] for r in ids] == expected


@pytest.mark.outer_only  # four workers: the two-worker layouts above cover the same code and files
def test_four_workers_across_tp_pp_layouts_match_hf(tmp_path_factory):
    """4 workers, 4 KV heads, 4 layers: [2,2] -> 2x2 -> 1x4 -> [2,1x2] -> [2,2] while requests decode."""
    from tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("pp4") / "llama", 0, hidden_size=64,
                                 intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=4)
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 8, 3, 60, seed=25)
    with ElasticModel.from_pretrained(path, workers=4, topology="2,2", kv_cache_memory=2 << 20,
                                      max_num_batched_tokens=64) as model:
        dep = model.deployment
        ids = _submit(dep, prompts)
        done = run_steps(dep, ids, {}, num_steps=3)
        for target in (["2x2"], ["1x4"], [2, "1x2"], [2, 2]):
            report = dep.reshape(target)
            assert report.committed and not report.preempted, target
            run_steps(dep, ids, done, num_steps=2)
        run_steps(dep, ids, done)
        assert [done[r] for r in ids] == [hf_greedy(reference, p, MAX_NEW) for p in prompts]
        assert dep.stats()["num_computed_prompt_tokens"] == sum(len(p) for p in prompts)


@pytest.mark.stress
@pytest.mark.parametrize("failing_worker", [0, 1])
def test_a_failing_stage_fails_the_step_at_once_and_the_pipeline_serves_on(pp_setup, failing_worker):
    import time

    from elastic_hf.parallel.worker_pool import WorkerError

    dep, prompts, expected = pp_setup
    dep.reshape(["1x2"])
    try:
        ids = _submit(dep, prompts[:4])
        done = run_steps(dep, ids, {}, num_steps=2)
        dep.pool.call(failing_worker, "arm_step_fault")
        started = time.perf_counter()
        with pytest.raises(WorkerError, match="fault injected|earlier pipeline stage failed"):
            # the first batch sent after the fault was armed fails; with batches in flight (cross-step
            # pipelining) its output is collected a step later
            for _ in range(dep.instances[0].runner.max_batches_in_flight() + 1):
                dep.step()
        assert time.perf_counter() - started < 10   # the status header, not the 120 s collective timeout
        run_steps(dep, ids, done)
        assert [done[r] for r in ids] == expected[:4]
    finally:
        dep.reshape([1, 1])
