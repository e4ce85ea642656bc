#!/usr/bin/env bash
# The GPU checks of docs/performance.md in one run (a lent device's time is short): the CUDA-only
# tests, then the overhead and throughput figures, each saved under $OUT (default ./gpu-figures).
#   bash benchmarks/gpu_checks.sh    # not yet timed on a GPU: the compiled configurations compile 4 times per model
# Needs torch with CUDA, tqdm, pytest and scikit-learn (the project's .venv, or a machine's python3 with
# them: fitforge is then imported from src/); stops at the first failing step.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-figures}
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__)" | tee -a "$OUT/gpu.txt"

# 0 host syncs per training step (sync debug mode as error), and the CUDA variants of the other tests.
$PY -m pytest -p no:cacheprovider -q -rs tests/handlers/test_cuda_syncs.py tests/benchmarks/test_benchmark_overhead.py \
    2>&1 | tee "$OUT/tests.txt"

# Fixed cost and per-step overhead against a hand-written loop on the GPU (A, B and Z).
OMP_NUM_THREADS=1 $PY benchmarks/overhead.py --device cuda --workload all --json > "$OUT/overhead.json"
OMP_NUM_THREADS=1 $PY benchmarks/overhead.py --device cuda --workload B --repeats 21 | tee "$OUT/overhead-B.txt"

# Samples/s of fit and a hand-written loop: the canonical CNNs at realistic batch sizes, fp32/bf16, eager/compiled.
$PY benchmarks/throughput.py --device cuda --models resnet18 alexnet --batch-size 128 --batches 50 --warmup 5 \
    --hand --table | tee "$OUT/throughput-128.md"
$PY benchmarks/throughput.py --device cuda --models resnet18 --batch-size 256 --batches 50 --warmup 5 \
    --configs eager-fp32 eager-bf16 --hand --table | tee "$OUT/throughput-256.md"
