"""The cost model fitted while serving (engine/cost_fit.py): stage reports of a pipeline (busy seconds over a step's
micro-batches, a stage's share of the layers, the LM head on the last stage only) recover the coefficients that
made them; reports that cannot determine them (decode-only steps of one shape) fit nothing until varied steps come."""
import random

import pytest

from elastic_hf.engine.cost_fit import MIN_SAMPLES, OnlineCostFit
from elastic_hf.engine.cost_model import Chunk, CostModel

TRUE = CostModel(alpha=3e-7, beta=2e-4, gamma=1.5e-3, lam=6e-4, head=2.5e-3, num_layers=30, min_tokens=1)
FRACTIONS = (14 / 30, 16 / 30)   # a 1x2 split of 30 layers: the last stage holds 16


def _report(fit: OnlineCostFit, micro_batches: list[list[Chunk]]) -> None:
    """What the two stages of a pipeline report for one step: their busy time by the true model."""
    for stage, fraction in enumerate(FRACTIONS):
        last = stage == len(FRACTIONS) - 1
        seconds = sum(TRUE.batch_cost(mb, fraction, last_stage=last) for mb in micro_batches)
        fit.add(micro_batches, fraction, last, seconds)


def _random_step(rng: random.Random) -> list[list[Chunk]]:
    micro_batches = []
    for _ in range(rng.randint(1, 3)):
        chunks = [Chunk(rng.randint(0, 900), rng.choice((1, 1, rng.randint(2, 256))), rng.random() < 0.7)
                  for _ in range(rng.randint(1, 6))]
        micro_batches.append(chunks)
    return micro_batches


def test_stage_reports_recover_the_coefficients():
    fit = OnlineCostFit(num_layers=30, source="test")
    rng = random.Random(0)
    fitted = None
    while fitted is None:
        _report(fit, _random_step(rng))
        fitted = fit.model()
        assert fit.num_samples <= 4 * MIN_SAMPLES, fit.last_error
    for name in ("alpha", "beta", "gamma", "lam", "head"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert fitted.num_layers == 30 and fitted.min_tokens >= 1 and fitted.source == "test"


def test_uniform_decode_steps_fit_nothing_until_varied_steps_come():
    fit = OnlineCostFit(num_layers=30)
    decode_step = [[Chunk(100, 1, True) for _ in range(8)]]
    for _ in range(3 * MIN_SAMPLES):
        _report(fit, decode_step)
        assert fit.model() is None
    assert fit.last_error is not None   # it tried, and said why it could not
    rng = random.Random(1)
    for _ in range(2 * MIN_SAMPLES):
        _report(fit, _random_step(rng))
        if fit.model() is not None:
            return
    pytest.fail(f"varied steps never determined the model: {fit.last_error}")


def test_reports_without_time_or_work_are_ignored():
    fit = OnlineCostFit(num_layers=30)
    fit.add([[Chunk(0, 4, True)]], 0.5, True, 0.0)
    fit.add([], 0.5, True, 0.01)
    assert fit.num_samples == 0
