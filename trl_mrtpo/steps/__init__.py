"""Step-level credit: process rewards and failure-suffix masking (the ``steps`` credit term, which the trainer
builds from ``process_rewards`` and ``failure_boundaries``), and the step labellers that score steps (a process
reward model, Math-Shepherd's rollouts). docs/step-credit.md."""

from .process_rewards import Step, StepCredit, step_spans

__all__ = ["Step", "StepCredit", "step_spans"]
