"""Callbacks for MRTPO runs: the credit curves saved at the end of training."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence

from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)


def logged_reward_names(log_history: list[dict]) -> list[str]:
    """The rewards TRL logged (``rewards/<name>/mean``), in the order of first appearance."""
    names: dict[str, None] = {}
    for entry in log_history:
        for key in entry:
            if key.startswith("rewards/") and key.endswith("/mean"):
                names.setdefault(key[len("rewards/") : -len("/mean")])
    return list(names)


class CreditPlotCallback(TrainerCallback):
    """Saves ``mrtpo_curves.png`` in ``output_dir`` at the end of training: per reward, its mean and the share of
    tokens holding 80 % of its q mass, per step (needs matplotlib). Add it as TRL's own callbacks are added:
    ``MRTPOTrainer(..., callbacks=[CreditPlotCallback()])``; ``trl-mrtpo train`` and the demo add it.

    Args:
        reward_names: the rewards to plot; None: every reward TRL logged.
    """

    def __init__(self, reward_names: Sequence[str] | None = None):
        self.reward_names = None if reward_names is None else list(reward_names)

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        if importlib.util.find_spec("matplotlib") is None:  # a core install: no plots, and say why
            logger.warning(
                'CreditPlotCallback needs matplotlib (pip install "trl-mrtpo[gym]" or matplotlib); '
                "mrtpo_curves.png was not written."
            )
            return
        from .viz import plot_credit_curves

        names = self.reward_names if self.reward_names is not None else logged_reward_names(state.log_history)
        path = os.path.join(args.output_dir, "mrtpo_curves.png")
        plot_credit_curves(state.log_history, names, path, args.credit_warmup_steps)
