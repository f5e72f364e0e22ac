"""Cross-step pipelining (engine/batch_queue.py): a 1x2 instance keeps two batches of disjoint sequences in flight,
so stage 0 computes one while stage 1 finishes the other. Greedy tokens equal HF's, seeded sampling equals the
drained pipeline's (pipeline_batches=1) token for token, the batches really overlap, and a reshape, an abort or a
worker's death with batches in flight loses nothing else."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from deployment_steps import run_steps
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    path = build_tiny_checkpoint("llama", tmp_path_factory.mktemp("xstep") / "llama", 0, num_hidden_layers=4,
                                 intermediate_size=256)
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 8, 3, 60, seed=31)
    return path, prompts, [hf_greedy(reference, p, MAX_NEW) for p in prompts]


def _run(dep, prompts, params_of):
    """Submit all, step to the end; (tokens of every sequence per request, most batches seen in flight)."""
    ids = [dep.add_request(None, p, params_of(i)) for i, p in enumerate(prompts)]
    done, deepest = {}, 0
    while len(done) < len(ids):
        for out in dep.step():
            if out.finished:
                done[out.request_id] = [c.token_ids for c in out.outputs]
        deepest = max(deepest, max(len(i.engine.batches.in_flight) for i in dep.instances))
    return [done[r] for r in ids], deepest


SAMPLED = [SamplingParams(temperature=0.9, seed=3, max_tokens=MAX_NEW),
           SamplingParams(temperature=1.0, top_p=0.8, seed=4, n=2, max_tokens=MAX_NEW),
           SamplingParams(temperature=0.0, max_tokens=MAX_NEW)]


def test_two_batches_in_flight_give_the_drained_pipelines_tokens(setup):
    path, prompts, expected = setup
    results = {}
    for batches in (None, 1):
        with ElasticModel.from_pretrained(path, workers=2, topology="1x2", kv_cache_memory=1 << 20,
                                          max_num_batched_tokens=32, pipeline_batches=batches) as model:
            dep = model.deployment
            assert dep.instances[0].runner.max_batches_in_flight() == (batches or 2)
            greedy, deepest = _run(dep, prompts, lambda i: SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
            assert [g[0] for g in greedy] == expected
            assert deepest == (2 if batches is None else 0)   # two batches really were in flight at once
            results[batches], _ = _run(dep, prompts, lambda i: SAMPLED[i % len(SAMPLED)])
            assert not dep.instances[0].engine.scheduler.in_flight
            assert dep.instances[0].engine.scheduler.kv.num_used == 0
    assert results[None] == results[1]   # each sequence samples from its own generator, whatever the batching


def test_a_long_prompt_advances_in_both_batches_in_flight(setup):
    """A lone prompt of many chunks: each chunk but the last samples nothing, so the next one rides in the batch
    behind it (Scheduler.continues_in_flight) and both batches in flight carry it; the greedy tokens stay HF's."""
    path, prompts, _ = setup
    long_prompt = [t for p in prompts for t in p][:200]
    reference, _ = load_hf_model(path)
    expected = hf_greedy(reference, long_prompt, MAX_NEW)
    with ElasticModel.from_pretrained(path, workers=2, topology="1x2", kv_cache_memory=1 << 20,
                                      max_num_batched_tokens=32, enable_prefix_caching=False) as model:
        dep = model.deployment
        engine = dep.instances[0].engine
        rid = dep.add_request(None, long_prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
        tokens, shared, steps_to_first = None, 0, None
        for step in range(200):
            for out in dep.step():
                if steps_to_first is None and out.outputs[0].token_ids:
                    steps_to_first = step + 1
                if out.finished:
                    tokens = out.outputs[0].token_ids
            owners = [{s.seq.request_id for s in so.scheduled} for so, _ in engine.batches.in_flight]
            shared += len(owners) == 2 and rid in owners[0] and rid in owners[1]
            if tokens is not None:
                break
        assert tokens == expected
        # 200 tokens in chunks of <= 32 (the per-batch budget): 7 chunks, each in flight beside its successor
        assert shared >= 5 and steps_to_first <= 9, (shared, steps_to_first)
        assert not engine.scheduler.in_flight and engine.scheduler.kv.num_used == 0


def test_reshape_and_worker_death_with_batches_in_flight(setup):
    """A reshape drains the batches in flight (their outputs come with the next step, nothing is recomputed); a
    request aborted while its step is in flight is dropped alone; a worker killed with two batches in flight is
    replaced and its instance's requests are recomputed exactly."""
    path, prompts, expected = setup
    with ElasticModel.from_pretrained(path, workers=2, topology="1x2", kv_cache_memory=1 << 20,
                                      max_num_batched_tokens=32, enable_prefix_caching=False) as model:
        dep = model.deployment
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
        ids = [dep.add_request(None, p, params) for p in prompts]
        done = run_steps(dep, ids, {}, num_steps=6)
        assert len(dep.instances[0].engine.batches.in_flight) == 2
        dep.reshape([1, 1])
        assert all(not i.engine.batches.in_flight for i in dep.instances)
        run_steps(dep, ids, done, num_steps=2)
        dep.reshape(["1x2"])
        run_steps(dep, ids, done)
        assert [done[r] for r in ids] == expected
        assert dep.stats()["num_computed_prompt_tokens"] == sum(len(p) for p in prompts)

        ids = [dep.add_request(None, p, params) for p in prompts]
        want = dict(zip(ids, expected))
        done = run_steps(dep, ids, {}, num_steps=6)
        engine = dep.instances[0].engine
        assert len(engine.batches.in_flight) == 2
        in_flight = {s.seq.request_id for so, _ in engine.batches.in_flight for s in so.scheduled}
        aborted = next(r for r in ids if r in in_flight and r not in done)
        dep.abort_request(aborted)   # its step is in flight: the output is dropped, its blocks go back
        ids.remove(aborted)
        dep.pool.kill(1)
        run_steps(dep, ids, done)
        assert aborted not in done
        assert [done[r] for r in ids] == [want[r] for r in ids]
        assert dep.num_recoveries == 1 and not dep.pool.check_health()
        assert dep.instances[0].engine.scheduler.kv.num_used == 0
