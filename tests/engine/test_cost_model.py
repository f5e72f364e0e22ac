"""The eq. 1-3 cost model (KunServe §4.3): least squares recovers known coefficients from noisy timings, the stage
split of a micro-batch's cost, MIN, the JSON file and its errors, and the token-linear baseline."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from elastic_hf.engine.cost_model import (Chunk, CostModel, choose_min_tokens, eq3_features, fit, fit_head,
                                          fit_token_linear, relative_errors)

TRUE = CostModel(alpha=2e-8, beta=3e-4, gamma=4e-3, lam=3e-3, head=1.5e-3, num_layers=30, min_tokens=64)


def _micro_batch(rng: random.Random) -> list[Chunk]:
    """Prefill chunks with and without a prefix, decodes, or both, 1-6 chunks."""
    chunks = []
    for _ in range(rng.randint(1, 6)):
        if rng.random() < 0.4:
            chunks.append(Chunk(rng.randint(16, 1024), 1, True))
        else:
            chunks.append(Chunk(rng.choice([0, rng.randint(0, 1024)]), rng.randint(8, 256), rng.random() < 0.5))
    return chunks


def _samples(model, count, noise, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chunks = _micro_batch(rng)
        out.append((chunks, model.batch_cost(chunks) * (1 + rng.uniform(-noise, noise))))
    return out


def test_least_squares_recovers_the_coefficients_within_10_percent_at_1_percent_noise():
    # 1 % uniform noise on 200 micro-batches: the small terms (head rows, attention at short prefixes) are a few
    # percent of a micro-batch's time, so their coefficients scatter by up to ~5 % over seeds; 10 % is the bound.
    fitted = fit(_samples(TRUE, 200, noise=0.01), TRUE.num_layers, source="synthetic")
    for name in ("alpha", "beta", "gamma", "lam", "head"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    assert fitted.num_layers == 30 and fitted.source == "synthetic"
    held_out = _samples(TRUE, 100, noise=0.0, seed=1)
    assert max(relative_errors(fitted, held_out)) < 0.01
    # The baseline cannot see attention: on the same micro-batches it is much further off.
    baseline = fit_token_linear(_samples(TRUE, 200, noise=0.01))
    assert sum(relative_errors(baseline, held_out)) > 5 * sum(relative_errors(fitted, held_out))


def test_chunk_and_batch_cost_follow_eq_1_to_3_and_the_stage_split():
    model = CostModel(alpha=1.0, beta=10.0, gamma=100.0, lam=30.0, head=1000.0, num_layers=4, min_tokens=1)
    a, b = Chunk(prefix=3, tokens=2), Chunk(prefix=0, tokens=1, sampled=True)
    assert model.chunk_cost(a) == (3 * 2 + 4 + 2) + 20 + 100
    assert model.chunk_cost(b) == (0 + 1 + 1) + 10 + 100 + 1000
    decoder = model.chunk_cost(a) + model.chunk_cost(b) - 1000 - 30   # eq. 3: one lam shared
    assert model.batch_cost([a, b]) == decoder + 1000
    assert model.batch_cost([a, b], layer_fraction=0.25, last_stage=False) == decoder / 4
    assert model.batch_cost([a, b], layer_fraction=0.25, last_stage=True) == decoder / 4 + 1000
    assert model.batch_cost([]) == 0.0
    # The same chunk later in its request costs more (prefix attention).
    assert model.chunk_cost(Chunk(100, 2)) > model.chunk_cost(Chunk(0, 2))


def test_min_tokens_is_where_the_token_work_reaches_the_fixed_cost():
    model = CostModel(alpha=0.0, beta=1e-3, gamma=5e-3, lam=0.0, head=0.0, num_layers=1, min_tokens=1)
    assert choose_min_tokens(model) == 5              # 1e-3 * 5 >= 5e-3
    assert choose_min_tokens(model, work_per_fixed=10) == 50
    quadratic = CostModel(alpha=1e-3, beta=0.0, gamma=1.0, lam=0.0, head=0.0, num_layers=1, min_tokens=1)
    assert choose_min_tokens(quadratic) == 32         # 1e-3 * (32 * 33) >= 1 > 1e-3 * (31 * 32)
    assert fit(_samples(TRUE, 200, 0.01), 30).min_tokens == pytest.approx(choose_min_tokens(TRUE), abs=3)
    assert fit(_samples(TRUE, 200, 0.01), 30, min_tokens=7).min_tokens == 7


def test_json_round_trip_and_file_errors(tmp_path):
    path = tmp_path / "cost.json"
    TRUE.save(path)
    assert CostModel.load(path) == TRUE
    assert json.loads(path.read_text())["format"] == 1
    with pytest.raises(FileNotFoundError, match="profile-cost"):
        CostModel.load(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cost.json.*not"):
        CostModel.load(path)
    path.write_text(json.dumps({"format": 99, "kind": "cost-model"}))
    with pytest.raises(ValueError, match="format 1"):
        CostModel.load(path)
    with_head = CostModel(1e-8, 3e-4, 4e-3, 3e-3, 1e-4, 30, 8, "x", head_fixed=5e-3)
    assert CostModel.from_json(with_head.to_json()) == with_head
    data = json.loads(with_head.to_json())
    del data["head_fixed"]   # a file written before the fixed head cost: none
    assert CostModel.from_json(json.dumps(data)).head_fixed == 0.0
    data = json.loads(TRUE.to_json())
    del data["lam"]
    with pytest.raises(ValueError, match="lam"):
        CostModel.from_json(json.dumps(data))
    with pytest.raises(ValueError, match="beta must be finite and >= 0, got -1"):
        CostModel(1.0, -1.0, 0.0, 0.0, 0.0, 1, 1)


def test_a_head_timed_alone_is_taken_off_the_forwards_and_the_decoder_terms_fitted_to_the_rest():
    """The LM head's weight stream is paid once by every micro-batch that samples (head_fixed): a regression on
    whole forwards cannot tell it from lam. Timed alone, it is fitted as a line over rows and subtracted."""
    true = CostModel(alpha=2e-8, beta=3e-4, gamma=4e-3, lam=3e-3, head=1e-4, num_layers=30, min_tokens=64,
                     head_fixed=6e-3)
    assert true.head_cost([Chunk(0, 8, False)]) == 0.0
    assert true.head_cost([Chunk(5, 1, True)] * 4) == pytest.approx(6e-3 + 4e-4)
    rng = random.Random(3)
    timings = [(rows, (6e-3 + 1e-4 * rows) * (1 + rng.uniform(-0.01, 0.01))) for rows in (1, 4, 16, 64) * 3]
    fixed, per_row = fit_head(timings)
    assert fixed == pytest.approx(6e-3, rel=0.05) and per_row == pytest.approx(1e-4, rel=0.05)
    fitted = fit(_samples(true, 200, noise=0.01), 30, head=(fixed, per_row))
    assert (fitted.head_fixed, fitted.head) == (fixed, per_row)
    for name in ("beta", "gamma", "lam"):
        assert getattr(fitted, name) == pytest.approx(getattr(true, name), rel=0.1), name
    held_out = _samples(true, 100, noise=0.0, seed=1)
    assert max(relative_errors(fitted, held_out)) < 0.03
    with pytest.raises(ValueError, match="2 row counts"):
        fit_head([(4, 1e-3), (4, 1.1e-3)])
    with pytest.raises(ValueError, match="takes all of"):
        fit(_samples(true, 20, noise=0.0), 30, head=(1.0, 0.0))


def test_fit_refuses_too_few_or_degenerate_samples():
    with pytest.raises(ValueError, match="at least 10 measured micro-batches, got 3"):
        fit(_samples(TRUE, 3, 0.0), 30)
    # One chunk per micro-batch: |b| equals the intercept column, gamma and lam cannot be told apart.
    single = [([Chunk(p, c, s)], TRUE.batch_cost([Chunk(p, c, s)]))
              for p in (0, 100, 500) for c in (8, 64, 200) for s in (False, True)]
    with pytest.raises(ValueError, match="condition number"):
        fit(single, 30)
    no_head = [([Chunk(c.prefix, c.tokens) for c in chunks], t) for chunks, t in _samples(TRUE, 50, 0.0)]
    with pytest.raises(ValueError, match="no sample has any.*sampled rows"):
        fit(no_head, 30)
    with pytest.raises(ValueError, match="finite and > 0"):
        fit([(chunks, 0.0) for chunks, _ in _samples(TRUE, 20, 0.0)], 30)


def test_a_negative_coefficient_is_clamped_to_zero_and_the_rest_refitted():
    # Timings with no attention cost at all, plus noise: the unconstrained alpha comes out either sign.
    flat = CostModel(alpha=0.0, beta=3e-4, gamma=4e-3, lam=3e-3, head=1.5e-3, num_layers=30, min_tokens=1)
    clamped = 0
    for seed in range(4):
        samples = _samples(flat, 200, noise=0.02, seed=seed)
        times = np.array([t for _, t in samples])
        features = np.array([eq3_features(chunks) for chunks, _ in samples]) / times[:, None]
        unconstrained_alpha = np.linalg.lstsq(features, np.ones_like(times), rcond=None)[0][0]
        fitted = fit(samples, 30)
        assert fitted.alpha >= 0 and fitted.lam >= 0 and fitted.gamma >= fitted.lam
        assert fitted.beta == pytest.approx(3e-4, rel=0.1)
        if unconstrained_alpha < 0:
            clamped += 1
            assert fitted.alpha == 0.0
    assert clamped >= 1   # the clamp really ran (seed 3)


def test_the_default_model_ships_a_cost_model_per_dtype():
    """Lookahead works out of the box on the default model: its fitted profiles ship with the package (float32,
    bfloat16); other models or dtypes have none (token counts, bytes)."""
    from elastic_hf.engine.cost_model import shipped_cost_model
    from elastic_hf.model.default_model import DEFAULT_MODEL_ID

    for dtype in ("float32", "bfloat16"):
        model = shipped_cost_model(DEFAULT_MODEL_ID, dtype)
        assert model is not None and model.num_layers == 30 and dtype in model.source
        assert model.batch_cost([Chunk(0, 64, True)]) > model.batch_cost([Chunk(0, 8, True)]) > 0
    assert shipped_cost_model(DEFAULT_MODEL_ID, "float16") is None
    assert shipped_cost_model("some/other-model", "float32") is None
