#!/usr/bin/env bash
# The GPU checks of docs/performance.md (a lent device's time is short), in parts that each fit one
# device call; outputs under $OUT (default ./gpu-figures). On an H100 (2026-11-27): tests 30 s,
# overhead 172 s, throughput 106 s with one pair per configuration (more with 5).
#   bash benchmarks/gpu_checks.sh tests         # CUDA-only tests: no host sync per step (a few minutes with compiles)
#   bash benchmarks/gpu_checks.sh overhead      # overhead.py --device cuda: workloads A, B and Z
#   bash benchmarks/gpu_checks.sh throughput    # fit vs a hand-written loop, ResNet-18/AlexNet, batch 128 and 256
#   bash benchmarks/gpu_checks.sh eager         # the same, eager configurations only (no compile time)
#   bash benchmarks/gpu_checks.sh gpt           # GPT-2 small pre-training: fit vs nanoGPT's loop, + AC, + Muon
#   bash benchmarks/gpu_checks.sh all           # every part, in this order
# Needs torch with CUDA, tqdm, pytest and scikit-learn (the project's .venv, or a machine's python3 with
# them: fitforge is then imported from src/). A failing part is reported and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-figures}
if [[ -z "${PY:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mkdir -p "$OUT"
status=0

tests() {
    $PY -m pytest -p no:cacheprovider -q -rs tests/handlers/test_cuda_syncs.py tests/core/test_rng.py \
        tests/benchmarks/test_benchmark_overhead.py -k "cuda or sync or device" 2>&1 | tee "$OUT/tests.txt"
}
overhead() {
    OMP_NUM_THREADS=1 $PY benchmarks/overhead.py --device cuda --workload all | tee "$OUT/overhead.txt"
}
throughput() {  # $1: the configurations; one pair of runs moves by up to 25% on an H100, so 5 pairs each
    $PY benchmarks/throughput.py --device cuda --models resnet18 alexnet --batch-size 128 --batches 50 --warmup 5 \
        --configs $1 --hand --pairs 5 --table | tee "$OUT/throughput-128.md"
    $PY benchmarks/throughput.py --device cuda --models resnet18 --batch-size 256 --batches 50 --warmup 5 \
        --configs eager-fp32 eager-bf16 --hand --pairs 5 --table | tee "$OUT/throughput-256.md"
}

gpt() {  # bf16 autocast, torch.compile, fused AdamW; the 4 variants compile once each (about a minute each)
    $PY benchmarks/gpt_pretrain.py --device cuda --size small --batch-size 16 --steps 20 --warmup 5 --pairs 1 \
        --precision bf16-mixed --compile | tee "$OUT/gpt.md"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__)" | tee -a "$OUT/gpu.txt" \
    || exit 1
case "${1:-all}" in
    tests) tests || status=1 ;;
    overhead) overhead || status=1 ;;
    throughput) throughput "eager-fp32 eager-bf16 compiled-fp32 compiled-bf16" || status=1 ;;
    eager) throughput "eager-fp32 eager-bf16" || status=1 ;;
    gpt) gpt || status=1 ;;
    all)
        tests || status=1
        overhead || status=1
        throughput "eager-fp32 eager-bf16 compiled-fp32 compiled-bf16" || status=1
        ;;
    *) echo "unknown part ${1}: tests, overhead, throughput, eager, gpt or all" >&2; exit 2 ;;
esac
exit $status
