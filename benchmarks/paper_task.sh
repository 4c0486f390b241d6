#!/usr/bin/env bash
# GDPO vs MRTPO on a paper task, on your GPU: instruction following with a 1.5B instruct model, 3 seeds, the
# protocol of benchmarks/paper_task_protocol.md (fixed before any run). Writes the same tables as the CPU grids
# (convergence.md, convergence_summary.csv, convergence_steps.csv, convergence.png) in OUTPUT_DIR.
#
#     bash benchmarks/paper_task.sh [OUTPUT_DIR]             # one GPU, ~24 GB, a few hours
#     DRY_RUN=1 bash benchmarks/paper_task.sh OUTPUT_DIR     # CPU, the embedded model, one step: checks the plumbing
#
# MODEL overrides the model (a folder or Hub id); runs resume from their checkpoints in OUTPUT_DIR/runs.
set -euo pipefail
cd "$(dirname "$0")/.."
output="${1:-benchmarks/results/paper_task}"
if [[ "${DRY_RUN:-0}" == "1" ]]; then
    exec python benchmarks/convergence.py --tasks if --methods gdpo mrtpo --seeds 200 --steps 1 --batch-size 2 \
        --num-generations 2 --max-completion-length 8 --eval-limit 1 --eval-max-new-tokens 8 --save-steps 1 \
        --threads 1 --work-dir "$output/runs" --output-dir "$output"
fi
python benchmarks/convergence.py --gpu --model "${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}" --tasks if \
    --methods gdpo mrtpo --seeds 200 201 202 --steps 200 --batch-size 16 --num-generations 8 \
    --max-completion-length 512 --learning-rate 1e-5 --temperature 1.0 --warmup-steps 10 --threshold 0.8 \
    --final-window 20 --eval-limit 541 --eval-max-new-tokens 1024 --save-steps 20 \
    --work-dir "$output/runs" --output-dir "$output"
