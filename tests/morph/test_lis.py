"""LIS profiler: determinism, the cached greedy equals a from-scratch evaluation, lazy vs exact greedy, the
profile JSON (round trip and validation against a model config), the fallback order and bad arguments."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.morph.lis import (LisConfig, calibration_batch, config_hash, fallback_order, load_profile,
                                  profile_lis)
from elastic_hf.morph.perplexity import swapped_layers
from elastic_hf.patches import get_adapter

SCHEME = QuantScheme.create("w4", 32, "rtn")


def _profile(model, seed=0, **overrides):
    config = LisConfig(samples=3, seq_len=32, seed=seed, **{"mds_samples": 3, "refresh": 0, **overrides})
    tokens = torch.randint(0, model.config.vocab_size, (4000,), generator=torch.Generator().manual_seed(123))
    calib_ids = calibration_batch(tokens, config.samples, config.seq_len, config.seed)
    return profile_lis(model, get_adapter(model.config), calib_ids, SCHEME, config, model_id="tiny",
                       progress=False), calib_ids


@pytest.fixture(scope="module")
def profiled(tiny_llama):
    """(model, LisResult, calib_ids) of one exact-greedy profile of the 4-layer tiny Llama, shared."""
    model = tiny_llama()
    result, calib_ids = _profile(model)
    return model, result, calib_ids


def test_profile_is_deterministic_for_a_fixed_seed(tiny_llama, profiled):
    _, first, _ = profiled
    second, _ = _profile(tiny_llama())
    assert first.profile.order == second.profile.order
    assert [s.lis for s in first.profile.steps] == [s.lis for s in second.profile.steps]
    assert first.profile.lts == second.profile.lts and first.profile.lrs == second.profile.lrs
    assert sorted(first.profile.order) == [0, 1, 2, 3]


def test_calibration_windows_depend_on_seed():
    tokens = torch.arange(10_000)
    a = calibration_batch(tokens, 4, 100, seed=0)
    assert torch.equal(a, calibration_batch(tokens, 4, 100, seed=0))
    assert not torch.equal(a, calibration_batch(tokens, 4, 100, seed=1))
    assert a.shape == (4, 100) and len({int(w[0]) // 100 for w in a}) == 4  # distinct, non-overlapping


def test_cached_greedy_matches_full_model_recomputation(profiled):
    """Every step's MDS must equal cos(f^(Q), f^(Q+p)) computed by running the whole model from scratch, and
    LIS must be the configured weighted sum (the prefix cache must not change any number)."""
    model, result, calib_ids = profiled
    adapter = get_adapter(model.config)
    config = result.profile.config

    def final_hidden(quantized):
        with swapped_layers(model, adapter, {i: result.references[i] for i in quantized}), torch.no_grad():
            return model.model(calib_ids).last_hidden_state  # final norm applied, [samples, seq, hidden]

    quantized: list[int] = []
    for step in result.profile.steps:
        before = final_hidden(quantized)
        after = final_hidden(quantized + [step.layer])
        expected_mds = F.cosine_similarity(before, after, dim=-1).mean().item()
        assert step.mds == pytest.approx(expected_mds, abs=2e-5)
        assert step.lis == pytest.approx(config.alpha1 * step.lts + config.alpha2 * step.lrs + config.beta * step.mds)
        # exact greedy: no other remaining candidate scores higher
        for other in set(range(4)) - set(quantized) - {step.layer}:
            mds = F.cosine_similarity(before, final_hidden(quantized + [other]), dim=-1).mean().item()
            lis = (config.alpha1 * result.profile.lts[other] + config.alpha2 * result.profile.lrs[other]
                   + config.beta * mds)
            assert lis <= step.lis + 1e-6
        quantized.append(step.layer)


def test_lts_and_lrs_are_cosines_of_layer_io(profiled):
    model, result, calib_ids = profiled
    with torch.no_grad():
        hidden = model.model(calib_ids, output_hidden_states=True).hidden_states
    # hidden_states[i] is layer i's input (the last one is after the final norm, so check the first layers)
    for i in range(3):
        expected = F.cosine_similarity(hidden[i + 1], hidden[i], dim=-1).mean().item()
        assert result.profile.lts[i] == pytest.approx(expected, abs=1e-5)
        assert 0.0 < result.profile.lrs[i] <= 1.0 + 1e-6


def test_lazy_greedy_runs_fewer_layers_and_keeps_a_permutation(tiny_llama):
    model = tiny_llama(num_layers=5)
    exact, _ = _profile(model, refresh=0)
    lazy, _ = _profile(model, refresh=1)
    assert sorted(lazy.profile.order) == list(range(5))
    assert lazy.profile.order[0] == exact.profile.order[0]  # step 1 scores every layer in both modes
    assert lazy.profile.timings["greedy_layer_forwards"] < exact.profile.timings["greedy_layer_forwards"]


def test_profile_json_roundtrip_and_validation(tiny_llama, profiled, tmp_path):
    model, result, _ = profiled
    path = tmp_path / "profile.json"
    result.profile.save(path)
    data = json.loads(path.read_text())
    for key in ("model_id", "config_hash", "quant_scheme", "order", "steps", "timings"):
        assert key in data
    assert data["quant_scheme"]["group_size"] == 32
    assert {"lts", "lrs", "mds", "lis", "layer"} <= set(data["steps"][0])
    loaded = load_profile(path, model.config)
    assert loaded.order == result.profile.order and loaded.scheme == SCHEME

    other = tiny_llama(num_layers=5)
    with pytest.raises(ValueError, match=r"4-layer model; this model has 5 layers"):
        load_profile(path, other.config)
    changed = tiny_llama()
    changed.config.rms_norm_eps = 1e-3
    with pytest.raises(ValueError, match=r"config hash is " + config_hash(changed.config)):
        load_profile(path, changed.config)
    data["order"] = [0, 0, 1, 2]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="permutation of 0..3"):
        load_profile(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_profile(tmp_path / "missing.json")


def test_fallback_order_is_front_to_back():
    assert fallback_order(5) == [0, 1, 2, 3, 4]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"samples=0 must be >= 1"):
        LisConfig(samples=0)
    with pytest.raises(ValueError, match=r"beta=1.5 must be in \[0, 1\]"):
        LisConfig(beta=1.5)
    with pytest.raises(ValueError, match=r"refresh=-1"):
        LisConfig(refresh=-1)
    with pytest.raises(ValueError, match=r"100 tokens: 3 windows of seq_len=32, but samples=8"):
        calibration_batch(torch.arange(100), 8, 32, 0)
