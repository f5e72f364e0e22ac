"""A load that hovers at the overload threshold for 40 s (requests added whenever the KV demand falls below the
undropped capacity, each finishing after a few tokens) must not make the arbiter oscillate: one drop, no restore
while the demand stays above the restore threshold, a bounded number of reshapes. The gauges follow the control
plane: the demand ratio is the snapshot's, and requests wait on the KV exchange right after the drop (the exchange's
record counts them) and never after it ends. Tokens equal HF greedy."""
import random
import time

import pytest

from elastic_hf import ElasticModel
from elastic_hf.engine.sampling_params import SamplingParams
from elastic_hf.model.loader import load_hf_model
from greedy_reference import hf_greedy

HOVER_S = 40.0
MAX_NEW = 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from tiny_models import build_tiny_checkpoint

    return build_tiny_checkpoint("llama", tmp_path_factory.mktemp("hover") / "llama", 0, num_hidden_layers=5,
                                 intermediate_size=2048)


def test_load_hovering_at_the_threshold_drops_once_and_does_not_oscillate(checkpoint):
    reference, tokenizer = load_hf_model(checkpoint)
    rng = random.Random(5)
    vocab = [t for t in range(100, 2000)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    with ElasticModel.from_pretrained(checkpoint, workers=2, kv_cache_memory=512 << 10, max_num_batched_tokens=64,
                                      overload="drop") as model:
        dep = model.deployment
        control = dep.overload
        base = control.snapshot().base_capacity_tokens
        prompts, done, exchanging_seen, ratios = {}, {}, [], []
        started = time.monotonic()
        while time.monotonic() - started < HOVER_S:
            while control.snapshot().demand_tokens < base:   # the demand at the undropped capacity: the trigger's edge
                prompt = [rng.choice(vocab) for _ in range(rng.randint(8, 40))]
                prompts[dep.add_request(None, prompt, params)] = prompt
            for out in dep.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
            exchanging_seen.append((control.exchange is not None, control.metrics.exchanging._value.get()))
            ratios.append((control.metrics.demand_ratio._value.get(), control.snapshot().demand_ratio,
                           len(dep.reshapes)))
        while len(done) < len(prompts):
            for out in dep.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        history = [h for h in control.history if h.get("outcome") == "committed"]
        drops = [h for h in history if h["event"] == "drop"]
        restores = [h for h in history if h["event"] == "restore"]
        assert len(drops) == 1 and not restores, history   # demand ~ base: above the restore line, below trigger
        assert len(dep.reshapes) <= 2
        assert len(prompts) > 40, len(prompts)   # the hover really churned requests
        # the gauge is the snapshot's ratio as the step left it (the next snapshot may see a request just added)
        # (but a step that reshaped changed the capacity after the gauge was set)
        steady = [(g, r) for (g, r, n), (_, _, before) in zip(ratios[1:], ratios) if n == before]
        # the drop came once the demand passed the capacity or, past predict_floor of it, was projected to
        assert all(abs(g - r) < 0.5 for g, r in steady) and max(g for g, _, _ in ratios) > control.policy.predict_floor
        # Running requests were parked behind the exchange (an exchange of one chunk may end before the next step
        # boundary samples the gauge, so the count comes from the exchange's own record), and none after it ended.
        exchanges = [h for h in control.history if h["event"] == "exchange_done"]
        assert len(exchanges) == 1 and exchanges[0]["parked_seqs"] > 0, control.history
        assert all(gauge == 0 for active, gauge in exchanging_seen if not active)
    for rid in list(prompts)[:12] + list(prompts)[-12:]:
        assert done[rid] == hf_greedy(reference, prompts[rid], MAX_NEW), rid
