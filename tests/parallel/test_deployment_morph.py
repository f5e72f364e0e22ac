"""Precision morphing inside a 2-worker deployment: each TP-1 instance's worker morphs its own layers and grows its own
KV cache (ledger per worker), greedy tokens after a forced morph and its restore equal an untouched run, a reshape
first brings morphed layers back to full precision, and a TP-2 instance refuses to morph."""
import pytest

from elastic_hf import ElasticModel
from elastic_hf.model.loader import load_hf_model
from elastic_hf.parallel.reshape import ReshapeAborted
from greedy_reference import hf_greedy, mixed_prompts

MAX_NEW = 12


@pytest.fixture(scope="module")
def setup(tp_checkpoint):
    path = tp_checkpoint("kv3")
    reference, tokenizer = load_hf_model(path)
    prompts = mixed_prompts(tokenizer, 4, 5, 40, seed=31)
    expected = [hf_greedy(reference, p, MAX_NEW) for p in prompts]
    model = ElasticModel.from_pretrained(path, workers=2, kv_cache_memory=2 << 20, morph="manual",
                                         morph_options={"use_cache": False, "w4_group_size": 32})
    yield model, prompts, expected
    model.close()


def _tokens(model, prompts):
    return [o.outputs[0].token_ids for o in model.generate(prompts, max_tokens=MAX_NEW)]


def test_each_worker_morphs_its_own_layers_and_grows_its_own_kv(setup):
    model, prompts, expected = setup
    assert _tokens(model, prompts) == expected
    before = model.memory_report()["workers"]
    state = model.morph.to_precision("all", "w4", instance=1)
    assert state["layer_counts"]["w4"] == 3 and state["worker"] == 1
    after = model.memory_report()["workers"]
    freed = before[1]["weights_bytes"] - after[1]["weights_bytes"]
    assert freed > 0 and after[1]["kv_blocks"] > before[1]["kv_blocks"]
    # the KV cache took what the weights gave up, down to the headroom and less than one block
    assert after[1]["free_bytes"] - after[1]["headroom_bytes"] < after[1]["kv_block_bytes"]
    assert model.instances[1].engine.scheduler.kv.num_total == after[1]["kv_blocks"]
    assert after[0] == {**before[0], "rss_bytes": after[0]["rss_bytes"], "rss_anon_bytes": after[0]["rss_anon_bytes"]}
    assert model.morph.state(0)["layer_counts"]["fp"] == 3       # worker 0 untouched
    assert len(_tokens(model, prompts)) == len(prompts)            # instance 1 now decodes with W4 layers
    model.morph.to_precision("all", "fp", instance=1)
    restored = model.memory_report()["workers"]
    assert restored[1]["weights_bytes"] == before[1]["weights_bytes"]
    assert restored[1]["kv_blocks"] == before[1]["kv_blocks"]
    assert _tokens(model, prompts) == expected                     # bit-identical fp weights are back


def test_reshape_restores_morphed_layers_first_and_tokens_stay_exact(setup):
    model, prompts, expected = setup
    model.morph.to_precision([0, 2], "w8", instance=0)
    report = model.reshape([2])
    assert report.committed and model.morph.states() == []         # no TP-1 instance is left to morph
    with pytest.raises(ValueError, match="runs at TP2 on workers \\[0, 1\\]"):
        model.morph.to_precision("all", "w4")
    assert _tokens(model, prompts) == expected
    model.reshape([1, 1])
    states = model.morph.states()
    assert [s["layer_counts"]["fp"] for s in states] == [3, 3]
    assert states[0]["swaps"]["w8->fp"] == 2                       # the reshape restored them
    assert _tokens(model, prompts) == expected


def test_reshape_is_refused_while_a_restore_waits_for_live_kv_blocks(setup):
    model, prompts, _ = setup
    from elastic_hf.engine.sampling_params import SamplingParams

    dep = model.deployment
    model.morph.to_precision("all", "w4", instance=0)
    allocator = model.instances[0].engine.scheduler.kv
    # Fill instance 0's grown cache with live blocks: restoring a layer (~100 blocks of fp weights) then needs
    # blocks that are in use.
    length = model.max_model_len - MAX_NEW
    per_request = -(-model.max_model_len // 16)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    ids = []
    while allocator.num_free >= per_request:   # distinct prompts: no request finds another's blocks cached
        first = 3 + len(ids)
        ids.append(dep.add_request(None, list(range(first, first + length)), params, instance=0))
        while dep.instances[0].engine.scheduler.waiting:
            dep.step()
    assert allocator.num_free < 64
    with pytest.raises(ReshapeAborted, match="below full precision"):
        model.reshape([2])
    assert str(dep.topology) == "[1,1]"
    for rid in ids:
        dep.abort_request(rid)
    model.morph.to_precision("all", "fp", instance=0)
    assert model.morph.state(0)["layer_counts"]["fp"] == 3
    assert model.reshape([2]).committed
    model.reshape([1, 1])


def test_structured_output_survives_a_morph_and_a_reshape_mid_generation(setup):
    """Grammar state lives with the sequence in the engine process and masks travel to the sampling worker each
    step: a JSON-schema request decoding across a W4 morph, its restore and a TP reshape stays valid JSON of its
    schema, and a fresh matcher accepts every one of its tokens."""
    import json

    from deployment_steps import run_steps
    from elastic_hf.engine.sampling_params import SamplingParams
    from elastic_hf.engine.structured_outputs import StructuredOutputsParams

    model, prompts, _ = setup
    dep = model.deployment
    item = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
            "required": ["kind", "ok"], "additionalProperties": False}
    constraint = StructuredOutputsParams(json={"type": "array", "items": item, "minItems": 4, "maxItems": 4})
    params = SamplingParams(temperature=0.0, max_tokens=80, structured_outputs=constraint)
    ids = [dep.add_request(None, p, params, instance=i % 2) for i, p in enumerate(prompts[:2])]
    done = run_steps(dep, ids, {}, num_steps=6)
    model.morph.to_precision("all", "w4", instance=0)
    run_steps(dep, ids, done, num_steps=6)
    assert not done, "the requests must still be decoding when the reshape starts"
    assert model.reshape([2]).committed          # restores instance 0's layers first, then merges
    run_steps(dep, ids, done)
    model.reshape([1, 1])
    for rid in ids:
        text = model.tokenizer.decode(done[rid], skip_special_tokens=True)
        items = json.loads(text)
        assert len(items) == 4 and all(set(x) == {"kind", "ok"} for x in items), text
        state = dep.input_processor.grammars.compile(constraint).state()
        assert all(state.consume(t) for t in done[rid])
