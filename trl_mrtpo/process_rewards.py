"""Moved to :mod:`trl_mrtpo.steps.process_rewards`; this path imports it, with a FutureWarning, until 0.3."""

from ._moved import alias

alias(__name__, "trl_mrtpo.steps.process_rewards")
