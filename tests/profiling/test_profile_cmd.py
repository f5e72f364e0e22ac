"""`elastic-hf profile`: CLI end to end on a tiny checkpoint (JSON, --evaluate table + PNG, --profile reuse), bad
arguments, data-file discovery, and the perplexity evaluator against HF's own loss."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from elastic_hf.patches import get_adapter
from elastic_hf.profiling.calibration import default_calibration_text, held_out_split, read_text, tokenize_file
from elastic_hf.profiling.perplexity import PerplexityEvaluator, eval_windows
from elastic_hf.serving.cli import main

FAST = ["--samples", "2", "--seq-len", "48", "--group-size", "32", "--awq-grid", "4", "--no-progress"]


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    """A small calibration/evaluation text: a slice of the shipped wikitext2."""
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text(default_calibration_text().read_text()[:20_000])
    return path


@pytest.fixture(scope="module")
def profiled_checkpoint(tiny_checkpoint, calib_file, tmp_path_factory):
    checkpoint = tiny_checkpoint("llama")
    out = tmp_path_factory.mktemp("profile") / "profile.json"
    rc = main(["profile", str(checkpoint), "--calib", str(calib_file), "--out", str(out),
               "--save-variants", str(out.parent / "variants"), *FAST])
    assert rc == 0
    return checkpoint, out


def test_profile_writes_json(profiled_checkpoint):
    checkpoint, out = profiled_checkpoint
    data = json.loads(out.read_text())
    num_layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    assert sorted(data["order"]) == list(range(num_layers))
    assert data["quant_scheme"] == {"quant": "w4", "group_size": 32, "method": "awq", "bits": 4}
    assert data["calibration"]["samples"] == 2 and data["calibration"]["seq_len"] == 48
    assert len(data["steps"]) == num_layers and data["timings"]["total_s"] > 0
    assert data["normalize"] == "minmax" and data["calibration"]["mds_metric"] == "nll"
    assert len(data["first_mds"]) == num_layers


def test_evaluate_with_existing_profile_prints_table_and_plot(profiled_checkpoint, calib_file, tmp_path, capsys):
    checkpoint, out = profiled_checkpoint
    plot = tmp_path / "table8.png"
    rc = main(["profile", str(checkpoint), "--calib", str(calib_file), "--evaluate", "--profile", str(out),
               "--variants", str(out.parent / "variants"), "--eval-windows", "2", "--eval-seq-len", "48",
               "--plot", str(plot), *FAST])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "loaded 3 w4-g32-awq layer variants" in printed
    for row in ("front-to-back", "back-to-front", "random (mean 3)", "LIS"):
        assert row in printed
    assert "0 (fp32)" in printed and "(all)" in printed and "second half" in printed
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("extra,message", [
    (["--quant", "w3"], "quant='w3' is not a known quantization scheme; allowed: w8, w4"),
    (["--method", "gptq"], "method='gptq' is not a known quantization method; allowed: rtn, awq"),
    (["--group-size", "128"], "group_size=128 does not divide the input dimension 64"),
    (["--group-size", "48"], "group_size=48 is not supported for w4; allowed: 32, 64, 128"),
])
def test_bad_arguments_fail_clearly(tiny_checkpoint, calib_file, capsys, extra, message):
    args = ["profile", str(tiny_checkpoint("llama")), "--calib", str(calib_file), "--no-progress", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_empty_calibration_file_fails_clearly(tiny_checkpoint, tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    assert main(["profile", str(tiny_checkpoint("llama")), "--calib", str(empty), "--no-progress"]) == 2
    assert "calib=" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"calib=.*empty.txt.*the text file is empty"):
        read_text(empty, "calib")


def test_default_calibration_text_ships_with_the_package():
    import elastic_hf

    path = default_calibration_text()
    package_dir = Path(elastic_hf.__file__).resolve().parent
    assert path.is_relative_to(package_dir) and path.stat().st_size > 1_000_000
    assert "Homarus gammarus" in path.read_text()[:200]  # the first article of WikiText-2's validation split


def test_held_out_split_does_not_overlap():
    tokens = torch.arange(1000)
    calib, held_out = held_out_split(tokens)
    assert calib.numel() + held_out.numel() == 1000 and int(calib.max()) < int(held_out.min())
    with pytest.raises(ValueError, match=r"eval windows=9 must be in \[1, 1\]"):
        eval_windows(held_out[:700], 500, 9)


def test_perplexity_matches_hf_loss(tiny_checkpoint, calib_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tiny_checkpoint("qwen2")
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    windows = eval_windows(tokenize_file(tokenizer, calib_file), 40, 3)
    evaluator = PerplexityEvaluator(model, get_adapter(model.config), windows)
    with torch.no_grad():
        expected = math.exp(model(windows, labels=windows).loss.item())
    assert evaluator.perplexity() == pytest.approx(expected, rel=1e-4)
    # replacing a layer by itself changes nothing; the prefix cache starts at that layer
    assert evaluator.perplexity({1: model.model.layers[1]}) == pytest.approx(expected, rel=1e-4)
