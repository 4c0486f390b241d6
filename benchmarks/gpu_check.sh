#!/usr/bin/env bash
# Everything GPU-only in one command of at most 5 minutes (benchmarks/gpu_check.py says what it measures).
#
#     bash benchmarks/prepare_gpu_wheels.sh          # here, once: .whl/ (wheels + the embedded model's tokenizer)
#     bash benchmarks/gpu_check.sh [OUTPUT_DIR]      # there: device `run` with carry [".whl"]
#     DRY=1 bash benchmarks/gpu_check.sh OUTPUT_DIR  # here: the dry run (CPU, toy sizes, Triton's interpreter)
#
# Writes OUTPUT_DIR (default $OUT/gpu_check, or benchmarks/results/gpu_check): each part's JSON and log as it goes,
# summary.txt (one line per part) and summary.json. Without CUDA, and not dry, it stops at once.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-${OUT:-benchmarks/results}/gpu_check}"
if [ "${DRY:-0}" = 1 ]; then
    exec python3 benchmarks/gpu_check.py "$output" --dry-run
fi
source benchmarks/gpu_env.sh
gpu_env benchmarks/gpu_check.sh
export OMP_NUM_THREADS=4
timeout 290 python3 benchmarks/gpu_check.py "$output"
