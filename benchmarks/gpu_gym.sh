#!/usr/bin/env bash
# The credit gym's larger grid on one GPU machine: 6 methods x 16 seeds, K=6 constraints, a 4-layer policy of
# width 128 (trl-mrtpo gym --large), several runs sharing the GPU. Budget: at most 8 minutes; runs are resumable,
# so a second call finishes what a first one left. Not run in CI.
#
#     bash benchmarks/prepare_gpu_wheels.sh                  # here, once
#     bash benchmarks/gpu_gym.sh [OUTPUT_DIR]                # there: device `run` with carry [".whl"]
#
# Writes OUTPUT_DIR (default $OUT/credit_gym_large, or benchmarks/results/credit_gym_large) as trl-mrtpo gym does.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-${OUT:-benchmarks/results}/credit_gym_large}"
source benchmarks/gpu_env.sh
gpu_env benchmarks/gpu_gym.sh
export OMP_NUM_THREADS=1
timeout 480 python3 -m trl_mrtpo.scripts.cli gym --large --jobs 8 --work-dir /tmp/gym_large --output-dir "$output"
