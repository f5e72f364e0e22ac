#!/usr/bin/env bash
# The GPU checks of docs/GPU.md in one command, for a CUDA machine that has PyTorch but not our other
# dependencies and no network. Wheels made beforehand go in .whl/ (see docs/GPU.md for the list and the pip
# download line); logs go to $OUT (default: gpu-logs/).
#
#   bash scripts/gpu_check.sh [tests|bench|all]   (default: all)
# Environment: GPU_TEST_TIMEOUT, GPU_BENCH_TIMEOUT, GPU_BENCH_1B_TIMEOUT (seconds), GPU_BENCH_REPEATS (rounds).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-logs}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
what=${1:-all}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'transformers', transformers.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/machine.txt"
status=0
if [[ $what == tests || $what == all ]]; then
    # tests/serving needs the HTTP stack (fastapi, openai), which the GPU image lacks; it has no GPU tests
    timeout "${GPU_TEST_TIMEOUT:-300}" python3 -m pytest -m gpu -v -p no:cacheprovider --durations=15 \
        --ignore=tests/serving tests > "$OUT/gpu_tests.log" 2>&1
    status=$?
    grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/gpu_tests.log"
fi
if [[ $what == bench || $what == all ]]; then
    timeout "${GPU_BENCH_TIMEOUT:-180}" python3 benchmarks/cuda_graphs.py --repeats "${GPU_BENCH_REPEATS:-3}" \
        --profile > "$OUT/cuda_graphs.log" 2>&1
    grep -v -E "Loading|Writing|rounds" "$OUT/cuda_graphs.log"
    timeout "${GPU_BENCH_1B_TIMEOUT:-200}" python3 benchmarks/cuda_graphs.py --repeats 2 --shape llama-3.2-1b \
        > "$OUT/cuda_graphs_1b.log" 2>&1
    grep -v -E "Loading|Writing|rounds" "$OUT/cuda_graphs_1b.log"
fi
exit "$status"
