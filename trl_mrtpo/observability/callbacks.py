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
        if isinstance(reward_names, str) or (
            reward_names is not None and not all(isinstance(name, str) for name in reward_names)
        ):
            raise TypeError(
                f"CreditPlotCallback(reward_names=...) takes a list of reward names, got {reward_names!r}"
                + (f" (write [{reward_names!r}] for one reward)" if isinstance(reward_names, str) else "")
            )
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

        logged = logged_reward_names(state.log_history)
        unknown = [name for name in self.reward_names or () if name not in logged]
        if unknown:  # an empty plot would be written otherwise
            logger.warning(
                f"CreditPlotCallback: no reward named {', '.join(map(repr, unknown))} was logged (logged: "
                f"{', '.join(logged) or 'none'}); mrtpo_curves.png was not written."
            )
            return
        names = self.reward_names if self.reward_names is not None else logged
        path = os.path.join(args.output_dir, "mrtpo_curves.png")
        if plot_credit_curves(state.log_history, names, path, getattr(args, "credit_warmup_steps", None)) is None:
            logger.warning(
                "CreditPlotCallback: the run logged no MRTPO credit metrics (a `grpo` run, or no step finished); "
                "mrtpo_curves.png was not written."
            )
