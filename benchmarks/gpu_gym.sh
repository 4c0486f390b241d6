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
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "benchmarks/gpu_gym.sh needs a CUDA device; none is available here." >&2
    exit 2
fi
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export OMP_NUM_THREADS=1
timeout 480 python3 -m trl_mrtpo.cli gym --large --jobs 8 --work-dir /tmp/gym_large --output-dir "$output"
