"""Callbacks the trainer adds: the credit curves saved at the end of training."""

from __future__ import annotations

import os

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)


class CreditPlotCallback(TrainerCallback):
    """Saves ``mrtpo_curves.png`` (per-reward mean and q concentration per step) in ``output_dir`` at the end."""

    def __init__(self, reward_names):
        self.reward_names = list(reward_names)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            import importlib.util

            from .viz import plot_credit_curves

            if importlib.util.find_spec("matplotlib") is None:  # a core install: no plots, and say why
                logger.warning(
                    'save_credit_plots needs matplotlib (pip install "trl-mrtpo[gym]" or matplotlib); '
                    "mrtpo_curves.png was not written."
                )
                return

            path = os.path.join(args.output_dir, "mrtpo_curves.png")
            plot_credit_curves(state.log_history, self.reward_names, path, args.credit_warmup_steps)
