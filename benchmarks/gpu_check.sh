#!/usr/bin/env bash
# Everything GPU-only in one command of at most 8 minutes (benchmarks/gpu_check.py says what it measures).
#
#     bash benchmarks/prepare_gpu_wheels.sh          # here, once: .whl/ (wheels + the embedded model's tokenizer)
#     bash benchmarks/gpu_check.sh [OUTPUT_DIR]      # there: device `run` with carry [".whl"]
#
# Writes OUTPUT_DIR (default $OUT/gpu_check, or benchmarks/results/gpu_check). Without CUDA it stops at once.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-${OUT:-benchmarks/results}/gpu_check}"
source benchmarks/gpu_env.sh
gpu_env benchmarks/gpu_check.sh
export OMP_NUM_THREADS=4
timeout 420 python3 benchmarks/gpu_check.py "$output"
