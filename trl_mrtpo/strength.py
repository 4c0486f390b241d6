"""Per-reward strength (docs/method.md, step 5): the running specificity of each reward's q and the per-reward beta
and resting rewards it gives. The maths is :func:`~trl_mrtpo.credit.relevance_specificity` and
:func:`~trl_mrtpo.credit.reward_strength`; this is the state a run carries between steps and checkpoints."""

from __future__ import annotations

import torch

from .constants import STRENGTH_MOMENTUM, STRENGTH_PROBE_INTERVAL
from .credit import ReduceSum, relevance_specificity, reward_strength
from .state import Stateful


class RewardStrength(Stateful):
    """Reward k's beta is ``beta_n * g_k``, ``g_k`` from the running specificity ``m_k`` of its q.

    ``floor`` None turns it off (every reward uses ``beta_n``: the published rule). ``m_k`` is NaN until the first
    reading, and ``g_k`` is then 1. ``m_k`` is checkpointed as ``specificity``.
    """

    state_entries = ("specificity",)

    def __init__(self, floor: float | None, num_rewards: int):
        self.floor = floor
        self.specificity = torch.full((num_rewards,), float("nan"), dtype=torch.float64)

    @property
    def active(self) -> bool:
        return self.floor is not None

    def read(
        self,
        relevance: torch.Tensor,
        replayed: torch.Tensor,
        reduce_sum: ReduceSum | None,
        groups: torch.Tensor | None = None,
    ) -> None:
        """Folds one train batch's reading into ``m_k`` (momentum ``STRENGTH_MOMENTUM``, the first reading taken as
        is; ``groups`` the information groups, None: each reward its own). A collective under data parallelism:
        every process calls it, with or without responses to read."""
        if not self.active:
            return
        reading = relevance_specificity(relevance, replayed, reduce_sum, groups).cpu()
        momentum = torch.where(torch.isnan(self.specificity), 0.0, STRENGTH_MOMENTUM).double()
        updated = momentum * torch.nan_to_num(self.specificity) + (1 - momentum) * reading
        self.specificity = torch.where(torch.isnan(reading), self.specificity, updated)

    def strengths(self) -> torch.Tensor:
        """``[K]`` ``g_k`` (1 each when off)."""
        if not self.active:
            return torch.ones_like(self.specificity)
        return reward_strength(self.specificity, self.floor)

    def betas(self, beta: float) -> float | torch.Tensor:
        """Step 5's beta: ``beta_n`` when off, else the ``[K]`` float32 ``beta_n * g_k``."""
        return (beta * self.strengths()).float() if self.active else beta

    def logged_betas(self, beta: float, reward_names: list[str]) -> dict[str, float]:
        """``mrtpo/beta/<reward>`` -> ``beta_n * g_k`` (nothing when off)."""
        if not self.active:
            return {}
        return {f"mrtpo/beta/{name}": beta * g for name, g in zip(reward_names, self.strengths().tolist())}

    def resting(self, step: int, warmup_steps: int, generation_batch: int) -> set[int]:
        """Rewards not replayed in the generation batch sampled at optimizer step ``step``: after warm-up, those
        whose ``g_k`` is 0, except in every ``STRENGTH_PROBE_INTERVAL``-th generation batch
        (:func:`generation_batch_index`), when their reading is refreshed."""
        if not self.active or step < warmup_steps or generation_batch % STRENGTH_PROBE_INTERVAL == 0:
            return set()
        return set((self.strengths() == 0).nonzero(as_tuple=True)[0].tolist())


def generation_batch_index(
    step: int, gradient_accumulation_steps: int, steps_per_generation: int, num_iterations: int
) -> int:
    """The generation batch (from 0) TRL samples at optimizer step ``step``: one every ``steps_per_generation x
    num_iterations`` micro-batches, ``gradient_accumulation_steps`` micro-batches per step. Readings come one per
    generation batch, so the probe counts these, not optimizer steps."""
    return step * gradient_accumulation_steps // (steps_per_generation * num_iterations)
