"""Prefix caching across elastic operations on 2 worker processes: a conversation's turns return to the instance
that caches its history (cache-aware routing), and its answers stay those of a model without a cache while the
deployment goes [1,1] -> [2] (TP reshape) -> [1x2] (PP reshape) -> [1,1] -> a parameter drop -> its restore. Each
change drops the caches of the instances it replaces (counted), and the new instances cache again from the next
turn on."""
from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from deployment_steps import run_steps
from greedy_reference import mixed_prompts

MAX_NEW = 8
BLOCK = 16


def _turn(dep, prompt, also=()):
    """One greedy answer through the deployment (and requests `also` to their end): (answer tokens, cached prompt
    tokens, instance it ran on)."""
    request_id = dep.add_request(None, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    instance = next(i for i, inst in enumerate(dep.instances) if request_id in inst.engine.requests)
    seq = dep.instances[instance].engine.requests[request_id].seqs[0]
    answer = run_steps(dep, [request_id, *also], {})[request_id]
    return answer, seq.num_cached_tokens, instance


def test_turns_follow_their_cache_and_stay_exact_across_reshapes_and_a_drop(tp_checkpoint):
    path = tp_checkpoint("kv3")
    with ElasticModel.from_pretrained(path, kv_cache_memory=4 << 20, enable_prefix_caching=False) as plain:
        turns = mixed_prompts(plain.tokenizer, 9, 20, 40, seed=31)
        expected, prompt = [], []
        for turn in turns:
            prompt = prompt + turn
            expected.append(plain.generate(prompt, max_tokens=MAX_NEW, ignore_eos=True).outputs[0].token_ids)
            prompt = prompt + expected[-1]
    with ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=4 << 20) as model:
        dep = model.deployment
        changes = {2: lambda: dep.reshape([2]), 4: lambda: dep.reshape(["1x2"]), 5: lambda: dep.reshape([1, 1]),
                   6: model.drop, 8: model.restore}    # before these turns
        prompt, answers, cached, dropped = [], [], [], []
        for k, turn in enumerate(turns):
            if k in changes:
                before = dep.stats()["prefix_cache_dropped_blocks"]
                assert changes[k]() is not None
                dropped.append(dep.stats()["prefix_cache_dropped_blocks"] - before)
            prompt = prompt + turn
            also = []
            if k == 1:   # a queued request makes the home instance the busier one: the history still wins
                also.append(dep.add_request(None, turns[5], SamplingParams(temperature=0.0, max_tokens=4),
                                            instance=home))
            answer, hit, instance = _turn(dep, prompt, also)
            if k == 0:
                home = instance
            elif k == 1:
                assert instance == home        # not the idle instance: the history is cached here
            answers.append(answer)
            cached.append(hit)
            prompt = prompt + answer
        assert answers == expected
        full = lambda k: (sum(map(len, turns[:k])) + k * MAX_NEW - 1) // BLOCK * BLOCK   # noqa: E731
        # after each reshape the first turn finds nothing (new instances), the next one its previous turn
        assert cached[0] == 0 and cached[1] == full(1) and cached[2] == 0 and cached[3] == full(3)
        assert cached[4] == 0 and cached[5] == 0 and cached[6] == 0 and cached[7] == full(7) and cached[8] == 0
        assert str(dep.topology) == "[1,1]" and len(dropped) == 5 and all(d > 0 for d in dropped)
