"""Callbacks the trainer adds: the credit curves saved at the end of training."""

from __future__ import annotations

import os

from transformers import TrainerCallback


class CreditPlotCallback(TrainerCallback):
    """Saves ``mrtpo_curves.png`` (per-reward mean and q concentration per step) in ``output_dir`` at the end."""

    def __init__(self, reward_names):
        self.reward_names = list(reward_names)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            from .viz import plot_credit_curves

            plot_credit_curves(state.log_history, self.reward_names, os.path.join(args.output_dir, "mrtpo_curves.png"))
