"""LIS profiler: determinism, the cached greedy equals a from-scratch evaluation, lazy vs exact greedy, the
profile JSON (round trip and validation against a model config), the fallback order and bad arguments."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from elastic_hf.layers.quant_scheme import QuantScheme
from elastic_hf.patches import get_adapter
from elastic_hf.profiling.calibration import calibration_batch
from elastic_hf.profiling.lis import profile_lis
from elastic_hf.profiling.perplexity import swapped_layers
from elastic_hf.profiling.profile_format import LisConfig, config_hash, fallback_order, load_profile, term_scale

SCHEME = QuantScheme.create("w4", 32, "rtn")


def _profile(model, seed=0, **overrides):
    # Pinned to eq. 5 on raw cosines unless a test overrides it: the exactness tests below check those numbers.
    config = LisConfig(samples=3, seq_len=32, seed=seed, **{"mds_samples": 3, "refresh": 0, "normalize": "none",
                                                           "mds_metric": "cosine", **overrides})
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
    LIS must be the configured weighted sum of the normalised terms (the prefix cache must not change any
    number)."""
    model, result, calib_ids = profiled
    adapter = get_adapter(model.config)

    def final_hidden(quantized):
        with swapped_layers(model, adapter, {i: result.references[i] for i in quantized}), torch.no_grad():
            return model.model(calib_ids).last_hidden_state  # final norm applied, [samples, seq, hidden]

    quantized: list[int] = []
    for step in result.profile.steps:
        before = final_hidden(quantized)
        after = final_hidden(quantized + [step.layer])
        expected_mds = F.cosine_similarity(before, after, dim=-1).mean().item()
        assert step.mds == pytest.approx(expected_mds, abs=2e-5)
        assert step.lis == pytest.approx(result.profile.lis(step.lts, step.lrs, step.mds))
        # exact greedy: no other remaining candidate scores higher
        for other in set(range(4)) - set(quantized) - {step.layer}:
            mds = F.cosine_similarity(before, final_hidden(quantized + [other]), dim=-1).mean().item()
            lis = result.profile.lis(result.profile.lts[other], result.profile.lrs[other], mds)
            assert lis <= step.lis + 1e-6
        quantized.append(step.layer)


def test_term_scale():
    values = [0.5, 1.0, 2.0, 4.5]
    assert term_scale(values, "minmax") == (0.5, 4.0)
    center, scale = term_scale(values, "zscore")
    assert center == pytest.approx(2.0) and scale == pytest.approx(torch.tensor(values).std(unbiased=False).item())
    assert term_scale(values, "none") == (0.0, 1.0)
    assert term_scale([0.7, 0.7], "minmax") == (0.7, 1.0)  # constant term: no division by zero


def test_normalised_lis_weights_every_term_by_its_spread(tiny_llama, profiled, tmp_path):
    """minmax maps LTS/LRS over all layers and MDS over the first (exhaustive) step to [0, 1] before weighting:
    the map is stored, step 1's winner maximises the normalised sum, and normalize="none" is the raw eq. 5."""
    model, _, _ = profiled
    result, _ = _profile(model, normalize="minmax")
    profile = result.profile
    lts, lrs, first_mds = profile.lts, profile.lrs, profile.first_mds
    assert len(first_mds) == 4 and first_mds[profile.order[0]] == profile.steps[0].mds
    assert profile.normalization == {"lts": [min(lts), max(lts) - min(lts)], "lrs": [min(lrs), max(lrs) - min(lrs)],
                                     "mds": [min(first_mds), max(first_mds) - min(first_mds)]}
    normalised = [0.25 * (lts[j] - min(lts)) / (max(lts) - min(lts))
                  + 0.25 * (lrs[j] - min(lrs)) / (max(lrs) - min(lrs))
                  + 0.5 * (first_mds[j] - min(first_mds)) / (max(first_mds) - min(first_mds)) for j in range(4)]
    assert profile.order[0] == max(range(4), key=normalised.__getitem__)
    assert profile.steps[0].lis == pytest.approx(max(normalised))
    assert 0.0 <= profile.steps[0].lis <= 1.0
    profile.save(tmp_path / "minmax.json")
    loaded = load_profile(tmp_path / "minmax.json", model.config)
    assert loaded.config.normalize == "minmax" and loaded.normalization == profile.normalization
    assert [loaded.lis(s.lts, s.lrs, s.mds) for s in loaded.steps] == pytest.approx([s.lis for s in profile.steps])

    raw, _ = profiled[1], None
    assert raw.profile.config.normalize == "none"  # eq. 5 on the raw cosines
    assert raw.profile.normalization == {"lts": [0.0, 1.0], "lrs": [0.0, 1.0], "mds": [0.0, 1.0]}
    assert raw.profile.first_mds == pytest.approx(first_mds, abs=1e-6)
    for step in raw.profile.steps:
        assert step.lis == pytest.approx(0.25 * step.lts + 0.25 * step.lrs + 0.5 * step.mds)
    # a term with weight 1 alone decides step 1 under either normalisation (the map is monotone)
    only_mds, _ = _profile(model, alpha1=0.0, alpha2=0.0, beta=1.0)
    assert only_mds.profile.order[0] == max(range(4), key=first_mds.__getitem__)


def test_kl_mds_is_exp_minus_kl_of_next_token_distributions(tiny_llama, profiled):
    """mds_metric="kl": MDS = exp(-KL(p_Q || p_Q+p)) of the full model's next-token distributions, per token,
    averaged; checked against whole-model runs for the first two greedy steps."""
    model, _, calib_ids = profiled
    adapter = get_adapter(model.config)
    result, _ = _profile(model, mds_metric="kl")
    assert result.profile.config.mds_metric == "kl"

    def log_probs(quantized):
        with swapped_layers(model, adapter, {i: result.references[i] for i in quantized}), torch.no_grad():
            return model(calib_ids).logits.float().log_softmax(-1)

    quantized: list[int] = []
    for step in result.profile.steps[:2]:
        before, after = log_probs(quantized), log_probs(quantized + [step.layer])
        kl = (before.exp() * (before - after)).sum(-1).mean().item()
        assert step.mds == pytest.approx(math.exp(-kl), abs=2e-5)
        quantized.append(step.layer)
    assert all(0.0 < m <= 1.0 + 1e-6 for m in result.profile.first_mds)


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
    assert data["normalize"] == "none" and set(data["normalization"]) == {"lts", "lrs", "mds"}
    loaded = load_profile(path, model.config)
    assert loaded.order == result.profile.order and loaded.scheme == SCHEME
    assert loaded.config.normalize == "none" and loaded.normalization == result.profile.normalization
    assert [loaded.lis(s.lts, s.lrs, s.mds) for s in loaded.steps] == [s.lis for s in loaded.steps]

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


def test_nll_mds_is_the_calibration_perplexity_ratio(profiled):
    """mds_metric="nll": MDS = exp(NLL_Q - NLL_Q+p) of the calibration tokens, checked against whole-model runs
    for the first two greedy steps; with beta alone the first pick is the layer whose quantization costs the
    least calibration likelihood."""
    model, _, calib_ids = profiled
    adapter = get_adapter(model.config)
    result, _ = _profile(model, mds_metric="nll")

    def nll(quantized):
        with swapped_layers(model, adapter, {i: result.references[i] for i in quantized}), torch.no_grad():
            logits = model(calib_ids).logits.float()[:, :-1]
            return F.cross_entropy(logits.flatten(0, 1), calib_ids[:, 1:].flatten()).item()

    quantized: list[int] = []
    for step in result.profile.steps[:2]:
        assert step.mds == pytest.approx(math.exp(nll(quantized) - nll(quantized + [step.layer])), rel=2e-5)
        quantized.append(step.layer)
    only_nll, _ = _profile(model, mds_metric="nll", alpha1=0.0, alpha2=0.0, beta=1.0)
    singles = [nll([]) - nll([j]) for j in range(4)]
    assert only_nll.profile.order[0] == max(range(4), key=singles.__getitem__)


def test_defaults_are_the_held_out_winner():
    """minmax-normalised terms with the calibration-perplexity MDS on 4 sequences: on SmolLM2-135M (W4 g64 AWQ)
    the only configuration measured no worse than front-to-back and random at k = 4, 8 and 16 (README)."""
    config = LisConfig()
    assert (config.normalize, config.mds_metric, config.mds_samples) == ("minmax", "nll", 4)
    assert (config.alpha1, config.alpha2, config.beta) == (0.25, 0.25, 0.5)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"samples=0 must be >= 1"):
        LisConfig(samples=0)
    with pytest.raises(ValueError, match=r"beta=1.5 must be in \[0, 1\]"):
        LisConfig(beta=1.5)
    with pytest.raises(ValueError, match=r"refresh=-1"):
        LisConfig(refresh=-1)
    with pytest.raises(ValueError, match=r"normalize='l2' is not one of minmax, zscore, none"):
        LisConfig(normalize="l2")
    with pytest.raises(ValueError, match=r"mds_metric='l2' is not one of cosine, kl, nll"):
        LisConfig(mds_metric="l2")
    with pytest.raises(ValueError, match=r"100 tokens: 3 windows of seq_len=32, but samples=8"):
        calibration_batch(torch.arange(100), 8, 32, 0)
