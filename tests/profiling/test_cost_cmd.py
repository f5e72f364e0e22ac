"""`elastic-hf profile-cost`: the CLI times a tiny checkpoint's forwards on the real data plane and writes a cost
model that CostModel.load reads; the grid varies what the fit needs; bad arguments fail with a message."""
from __future__ import annotations

import math

from elastic_hf.engine.cost_model import CostModel, eq3_features
from elastic_hf.profiling.cost_profile import GRIDS, grid_micro_batches
from elastic_hf.serving.cli import main


def test_profile_cost_writes_a_cost_model(tiny_checkpoint, tmp_path, capsys):
    checkpoint = tiny_checkpoint("llama")
    out = tmp_path / "cost.json"
    rc = main(["profile-cost", str(checkpoint), "--grid", "small", "--repeats", "1", "--out", str(out),
               "--no-progress"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "MIN" in printed and "in-sample relative error" in printed and str(out) in printed
    model = CostModel.load(out)
    coefficients = [model.alpha, model.beta, model.gamma, model.lam, model.head, model.head_fixed]
    assert all(math.isfinite(c) and c >= 0 for c in coefficients)
    assert model.head + model.head_fixed > 0      # the LM head, timed alone, costs something
    assert "timed alone at 1, 4, 16, 64 rows" in printed
    assert model.gamma > 0                        # a forward always costs something
    assert model.alpha + model.beta > 0           # and more work costs more
    assert model.gamma >= model.lam               # a chunk costs at least what batching can share of it
    assert model.num_layers == 3 and model.min_tokens >= 1
    assert "llama" in model.source and "grid small" in model.source


def test_every_grid_varies_each_regressor():
    for grid in GRIDS.values():
        batches = grid_micro_batches(grid, max_positions=1 << 20)
        columns = list(zip(*(eq3_features(chunks) for chunks in batches)))
        varied = [len(set(column)) > 1 for column in columns]
        assert varied == [True, True, True, False, True]   # the intercept column is constant by design
        assert all(sum(c.tokens for c in chunks) <= grid.max_tokens for chunks in batches)
    short = grid_micro_batches(GRIDS["full"], max_positions=300)
    assert short and all(c.prefix + c.tokens <= 300 for chunks in short for c in chunks)


def test_profile_cost_reports_bad_arguments(tmp_path, capsys):
    assert main(["profile-cost", str(tmp_path / "missing"), "--grid", "small"]) == 2
    assert "neither a local checkpoint directory" in capsys.readouterr().err
    assert main(["profile-cost", str(tmp_path), "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
