"""Every script in examples/ runs end to end on the tiny random Llama (with the default model's real tokenizer) as a
user would run it: `python examples/X.py --model <checkpoint> ...small flags`, in a temporary working directory.
Each must exit 0 and print its key lines (greedy text back after a morph restore, reshapes committed, ...); a
new example without an entry in EXAMPLES fails test_every_example_has_a_test_and_a_readme_line."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT_S = 300   # per example; they take seconds on an idle machine
FAST_PROFILE = ["--samples", "2", "--seq-len", "48", "--group-size", "32", "--awq-grid", "4", "--no-progress"]


def _run(script: str, args: list[str], cwd: Path) -> str:
    # One OpenMP thread: the tiny model gains nothing from more, and on a busy CI machine spinning OpenMP threads
    # that lose their core make every matmul tens of times slower.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(EXAMPLES_DIR / script), *args], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, (f"{script} exited with {result.returncode}\n--- stdout\n{result.stdout}\n"
                                    f"--- stderr\n{result.stderr[-6000:]}")
    # every "... equals ...: True" style check the example prints must hold
    assert not re.search(r": False$", result.stdout, re.M), result.stdout
    return result.stdout


def _check_offline_generate(out: str) -> None:
    assert re.match(r"loaded llama: max_model_len=\d+", out)     # the model id is the checkpoint dir's name
    for line in ("greedy repeats: True", "seeded sampling repeats: True", "stream equals greedy generate: True"):
        assert line in out
    assert out.count("batch: ") == 3 and "sampled[1]: " in out and "chat: " in out
    assert re.search(r"memory: weights [\d.]+ MiB, KV [\d.]+ MiB \(\d+ blocks of 16 tokens\)", out)


def _check_openai_client(out: str) -> None:
    assert "served model: llama" in out
    assert re.search(r"usage: \d+ prompt \+ 8 completion tokens", out)
    assert "streamed chat equals chat: True" in out
    assert "server stopped (exit code 0)" in out


def _check_force_morph(out: str) -> None:
    assert "[w4] layers {'fp': 0, 'w8': 0, 'w4': 3}" in out
    grown = int(re.search(r"\[w4\] layers .* KV blocks \d+ \(\+(\d+) vs fp\)", out).group(1))
    assert grown > 0, "the weights freed by W4 must become KV blocks"
    assert "[restored] layers {'fp': 3, 'w8': 0, 'w4': 0}" in out and "(+0 vs fp)" in out
    fp = re.search(r"^fp greedy: (.*)$", out, re.M).group(1)
    assert re.search(r"^restored greedy: (.*)$", out, re.M).group(1) == fp
    assert "restored equals original: True" in out


def _check_reshape_deployment(out: str) -> None:
    reports = re.findall(r"^reshape (\S+) -> (\S+): committed=(\w+) seconds=[\d.]+ num_moved_seqs=(\d+)$", out, re.M)
    assert [(old, new, committed) for old, new, committed, _ in reports] == [
        ("[1,1]", "[2]", "True"), ("[2]", "[1,1]", "True"), ("[1,1]", "[1x2]", "True"), ("[1x2]", "[1,1]", "True"),
        ("[1,1]", "[2]", "True"), ("[2]", "[1,1]", "True")]
    assert reports[0][3] == "1", "the first reshape happens while a request is decoding: it moves"
    assert "request decoded across the reshape equals [1,1] greedy: True" in out
    assert out.count("[2] greedy equals [1,1]: True") == 2 and "[1,1] greedy equals [1,1]: True" in out
    assert "[1x2] stages hold layers [(0, 2), (2, 3)]" in out and "[1x2] greedy equals [1,1]: True" in out
    assert "instance 1 morphed: layers {'fp': 0, 'w8': 0, 'w4': 3}" in out
    assert "instance 0: layers {'fp': 3, 'w8': 0, 'w4': 0}" in out
    assert "after split: layers [{'fp': 3, 'w8': 0, 'w4': 0}, {'fp': 3, 'w8': 0, 'w4': 0}]" in out


def _check_profile_layers(out: str) -> None:
    assert "wrote lis-profile.json" in out
    order = re.search(r"^LIS order \(first = swapped first\): \[(.*)\]$", out, re.M).group(1)
    assert sorted(int(i) for i in order.split(",")) == [0, 1, 2]
    assert "scheme QuantScheme(quant='w4', group_size=32, method='awq')" in out
    assert "serving with morph=default, controller on: True" in out
    assert "served order equals profile: True" in out


# script -> (extra arguments after --model, output check)
EXAMPLES = {
    "offline_generate.py": (["--max-tokens", "8", "--kv-cache-memory", "8MiB"], _check_offline_generate),
    "openai_client.py": (["--max-tokens", "8", "--kv-cache-memory", "8MiB"], _check_openai_client),
    "force_morph.py": (["--max-tokens", "8", "--kv-cache-memory", "8MiB", "--no-variant-cache"], _check_force_morph),
    "reshape_deployment.py": (["--max-tokens", "8", "--kv-cache-memory", "8MiB", "--no-variant-cache"],
                              _check_reshape_deployment),
    "profile_layers.py": (["--max-tokens", "8", "--kv-cache-memory", "8MiB", "--no-variant-cache", *FAST_PROFILE,
                           "--calib", "calib.txt"], _check_profile_layers),
}


def test_every_example_has_a_test_and_a_readme_line():
    scripts = sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))
    assert scripts == sorted(EXAMPLES), "add an entry to EXAMPLES for every script in examples/"
    readme = (EXAMPLES_DIR / "README.md").read_text()
    for script in scripts:
        assert script in readme, f"examples/README.md does not mention {script}"
        source = (EXAMPLES_DIR / script).read_text()
        # spawned worker processes re-import the main module: the guard is required
        assert 'if __name__ == "__main__":' in source and '"--model"' in source, script


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs(script, tiny_checkpoint, tmp_path):
    if script == "profile_layers.py":   # a small slice of the shipped calibration text keeps the profiler quick
        from elastic_hf.profiling.calibration import default_calibration_text

        (tmp_path / "calib.txt").write_text(default_calibration_text().read_text()[:20_000])
    args, check = EXAMPLES[script]
    out = _run(script, ["--model", str(tiny_checkpoint("llama")), *args], tmp_path)
    try:
        check(out)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- {script} printed:\n{out}") from None


def test_openai_client_with_base_url_uses_a_running_server(tiny_checkpoint, tmp_path):
    """--base-url: the example talks to a server someone else started (here: `elastic-hf serve` by the test)."""
    sys.path.insert(0, str(EXAMPLES_DIR))
    dont_write_bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True   # no examples/__pycache__
    try:
        import openai_client
    finally:
        sys.path.remove(str(EXAMPLES_DIR))
        sys.dont_write_bytecode = dont_write_bytecode
    port = openai_client.free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([sys.executable, "-m", "elastic_hf.serving.cli", "serve", str(tiny_checkpoint("llama")),
                               "--port", str(port), "--api-key", "test-key", "--kv-cache-memory", "8MiB",
                               "--log-level", "warning"], cwd=tmp_path, env=env)
    try:
        openai_client.wait_healthy(f"http://127.0.0.1:{port}", server, "test-key", timeout=TIMEOUT_S)
        out = _run("openai_client.py", ["--base-url", f"http://127.0.0.1:{port}/v1", "--api-key", "test-key",
                                        "--max-tokens", "8"], tmp_path)
    finally:
        openai_client.stop_server(server)
    assert "starting:" not in out and "server stopped" not in out     # it used the running server
    assert "served model: llama" in out and "streamed chat equals chat: True" in out
    assert server.returncode == 0
