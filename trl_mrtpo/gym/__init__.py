"""Credit gym: a synthetic multi-constraint task where the tokens each reward depends on are known (see
:mod:`trl_mrtpo.gym.task`), RL runs of every credit mode on it, and the paired comparison that
``trl-mrtpo gym`` writes."""

from .grid import METHODS, Grid, Run, large_grid, quick_grid, run_all
from .runs import RunSettings, localisation, mass_ratio, oracle_relevance, satisfaction, step_record, train_run
from .stats import steps_to_threshold, wilcoxon_signed_rank
from .task import (
    KINDS,
    VARIANTS,
    Constraint,
    GymSpec,
    build_tokenizer,
    constraint_blocks,
    constraint_rewards,
    parse_constraints,
    prompt_text,
    relevant_positions,
    sample_constraints,
    supervised_policy,
    supervised_response,
    variant_spec,
)

__all__ = [
    "KINDS",
    "METHODS",
    "VARIANTS",
    "Constraint",
    "Grid",
    "GymSpec",
    "Run",
    "RunSettings",
    "build_tokenizer",
    "constraint_blocks",
    "constraint_rewards",
    "large_grid",
    "localisation",
    "mass_ratio",
    "oracle_relevance",
    "parse_constraints",
    "prompt_text",
    "quick_grid",
    "relevant_positions",
    "run_all",
    "sample_constraints",
    "satisfaction",
    "step_record",
    "steps_to_threshold",
    "supervised_policy",
    "supervised_response",
    "train_run",
    "variant_spec",
    "wilcoxon_signed_rank",
]
