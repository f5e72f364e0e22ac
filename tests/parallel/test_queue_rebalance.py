"""Queue rebalancing on 2 worker processes (engine/rebalance.py, Deployment._rebalance_queues): routing binds
requests on arrival by request count, so a burst of alternating long and short prompts leaves every long one
queued behind instance 0 while instance 1 finishes its short ones and idles. Requests that have not started move
to instance 1's queue: the burst is done in fewer steps, and every answer is still the untouched model's."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from deployment_steps import run_steps
from greedy_reference import mixed_prompts

BUDGET = 64          # tokens a step: a 192-token prompt prefills in 3 steps
MAX_NEW = 4


def _burst(dep, prompts):
    """Every prompt added at once: (ids, the instance each was routed to, {id: tokens}, deployment steps until all
    finished)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [dep.add_request(None, p, params) for p in prompts]
    routed = [next(i for i, inst in enumerate(dep.instances) if r in inst.engine.requests) for r in ids]
    calls = 0
    done: dict[str, list[int]] = {}
    while len(done) < len(ids):
        run_steps(dep, ids, done, num_steps=1)
        calls += 1
    return ids, routed, done, calls


def _alternating(tokenizer, seed):
    """Four long prompts and four short ones, alternating: long, short, long, ..."""
    longs = mixed_prompts(tokenizer, 4, 180, 192, seed=seed)
    shorts = mixed_prompts(tokenizer, 4, 6, 8, seed=seed + 1)
    return [p for pair in zip(longs, shorts) for p in pair]


@pytest.mark.timeout(300)
def test_a_burst_queued_behind_one_instance_moves_to_the_idle_one_and_stays_exact(tp_checkpoint):
    path = tp_checkpoint("kv3")
    with ElasticModel.from_pretrained(path, kv_cache_memory=4 << 20, max_num_batched_tokens=BUDGET) as plain:
        # two bursts of other prompts: the second must not find the first's prefixes cached on instance 0
        bursts = [_alternating(plain.tokenizer, seed) for seed in (5, 8)]
        expected = [[o.outputs[0].token_ids for o in plain.generate(b, max_tokens=MAX_NEW, ignore_eos=True)]
                    for b in bursts]
    with ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=BUDGET) as model:
        dep = model.deployment
        dep.config.rebalance_queues = False   # routing alone first, on the same deployment
        ids, routed, done, steps_routed = _burst(dep, bursts[0])
        assert routed == [0, 1] * 4, routed   # the long prompts all went to instance 0 (fewest requests, then index)
        assert [done[i] for i in ids] == expected[0]
        assert dep.balancer.num_moved == 0

        dep.config.rebalance_queues = True
        ids, routed, done, steps_moved = _burst(dep, bursts[1])
        assert routed == [0, 1] * 4, routed
        assert [done[i] for i in ids] == expected[1]
        # Instance 0 keeps the first long prompt and those it reaches as soon; the others run on instance 1.
        assert dep.balancer.num_moved >= 2
        assert dep.stats()["num_moved_requests"] == dep.balancer.num_moved
        assert steps_moved < steps_routed, (steps_moved, steps_routed)


@pytest.mark.timeout(300)
def test_pinned_requests_stay_on_their_instance(tp_checkpoint):
    path = tp_checkpoint("kv3")
    with ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=4 << 20,
                                      max_num_batched_tokens=BUDGET) as model:
        dep = model.deployment
        prompts = mixed_prompts(model.tokenizer, 4, 180, 192, seed=7)
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        ids = [dep.add_request(None, p, params, instance=0) for p in prompts]
        seen = set()
        done: dict[str, list[int]] = {}
        while len(done) < len(ids):
            run_steps(dep, ids, done, num_steps=1)
            seen |= {r for r in ids if r in dep.instances[1].engine.requests}
        assert not seen and dep.balancer.num_moved == 0
