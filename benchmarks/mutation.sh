#!/usr/bin/env bash
# Mutation testing of the advantage path with mutmut (configured in pyproject.toml, [tool.mutmut]).
# Run from the repository root; one core; resumable (mutmut keeps finished mutants in mutants/).
#   bash benchmarks/mutation.sh            # run, then write benchmarks/results/mutation/summary.md
#   bash benchmarks/mutation.sh --report   # only rewrite the summary from what has run so far
set -euo pipefail
export OMP_NUM_THREADS=1
export PYTHONPATH="$PWD/mutants${PYTHONPATH:+:$PYTHONPATH}"  # processes the tests launch (DDP) import the mutants too
FUNCTIONS=(
  "trl_mrtpo.credit.*" "trl_mrtpo.strength.*" "trl_mrtpo.rules.*"
  "trl_mrtpo.replay.x_padded*" "trl_mrtpo.replay.x_context_tree*" "trl_mrtpo.replay.xǁContextNodeǁ*"
  "trl_mrtpo.replay.xǁ_Decoderǁ*" "trl_mrtpo.replay.x_packed_rows*" "trl_mrtpo.replay.x_packed_mask*"
  "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_calculate_rewards*" "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_beta*"
  "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_weighted_batch*" "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_contributions*"
  "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_token_credit*" "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_replay_inputs*"
  "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_replay_record*" "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_replay__*"
  "trl_mrtpo.trainer.xǁMRTPOTrainerǁ_generate_and_score_completions*"
)
if [[ "${1:-}" != "--report" ]]; then
  for pattern in "${FUNCTIONS[@]}"; do mutmut run --max-children 1 "$pattern"; done
fi
mutmut results --all true > benchmarks/results/mutation/results.txt 2>&1 || true
python benchmarks/mutation_summary.py benchmarks/results/mutation/results.txt "${FUNCTIONS[@]}" \
  > benchmarks/results/mutation/summary.md
