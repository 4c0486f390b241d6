"""Response-level reward weighting (docs/method.md, response-level weighting): how much each reward counts, never
where its credit lands, so it stacks with every ``credit_assignment`` mode.

- ``static``: TRL's ``reward_weights`` c_k.
- ``saw``: c_k scaled by ``K * CV_k / sum_j CV_j``, the batch coefficient of variation of each reward (SAW-style).
- ``concur``: CONCUR's order-preserving projection of the gated auxiliary advantages onto the primary reward's
  order, per group, with a ceiling tie governed by a batch-level trust state.

Shapes: ``N`` responses (consecutive groups of ``G``), ``K`` rewards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..credit import group_advantages
from .config import CONCUR_CEILING_MODES, CONCUR_MIN_READINGS

CV_MEAN_FLOOR = 1e-6  # |mean| below this: the reward's CV is taken as 0 (no signal to weigh)


def saw_weights(rewards: torch.Tensor) -> torch.Tensor:
    """``[K]`` SAW-style weights ``K * CV_k / sum_j CV_j`` with ``CV_k = std_k / |mean_k|`` over the batch.

    NaN rewards (not applicable) are ignored. A reward with ``|mean| < 1e-6`` or fewer than two values has CV 0;
    when every CV is 0 the weights are all 1 (nothing to reweigh). The weights sum to K.
    """
    k = rewards.shape[1]
    cvs = []
    for column in rewards.T:
        values = column[~torch.isnan(column)].double()
        if values.numel() < 2 or values.mean().abs() < CV_MEAN_FLOOR:
            cvs.append(0.0)
        else:
            cvs.append((values.std() / values.mean().abs()).item())
    total = sum(cvs)
    if total == 0:
        return torch.ones(k)
    return torch.tensor([k * cv / total for cv in cvs], dtype=torch.float32)


def pava(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted isotonic regression: the nondecreasing sequence nearest to ``values`` in weighted least squares
    (pool-adjacent-violators). ``weights`` > 0."""
    blocks: list[list[float]] = []  # [weighted mean, total weight, count]
    for value, weight in zip(values.tolist(), weights.tolist()):
        blocks.append([value, weight, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            mean_b, weight_b, count_b = blocks.pop()
            mean_a, weight_a, count_a = blocks.pop()
            total = weight_a + weight_b
            blocks.append([(mean_a * weight_a + mean_b * weight_b) / total, total, count_a + count_b])
    return torch.tensor([mean for mean, _, count in blocks for _ in range(count)], dtype=values.dtype)


def concur_project(
    primary: torch.Tensor, auxiliary: torch.Tensor, tie_ceiling: bool, ceiling: float = 1.0
) -> torch.Tensor:
    """CONCUR's nearest order-preserving auxiliary advantages within one group.

    Constraint: a response with a strictly higher primary reward never gets a lower auxiliary advantage; responses
    with equal primary (below the ceiling) are unconstrained among themselves, so they are ordered by their own
    auxiliary value before PAVA, which then only repairs real cross-primary violations. With ``tie_ceiling``, the
    responses whose primary reaches ``ceiling`` must be equal (they start as one pooled block). Already feasible
    input is returned unchanged; the result is not re-standardised.

    Args:
        primary: ``[G]`` raw primary rewards; auxiliary: ``[G]`` auxiliary advantages.
    """
    order = sorted(range(len(primary)), key=lambda i: (primary[i].item(), auxiliary[i].item()))
    at_ceiling = [i for i in order if tie_ceiling and primary[i].item() >= ceiling]
    below = [i for i in order if i not in at_ceiling]
    values = [auxiliary[i].item() for i in below]
    weights = [1.0] * len(below)
    if at_ceiling:  # one pooled block, after every lower-primary response
        values.append(sum(auxiliary[i].item() for i in at_ceiling) / len(at_ceiling))
        weights.append(float(len(at_ceiling)))
    fitted = pava(torch.tensor(values, dtype=torch.float64), torch.tensor(weights, dtype=torch.float64))
    out = auxiliary.clone()
    for position, i in enumerate(below):
        out[i] = fitted[position].to(out.dtype)
    for i in at_ceiling:
        out[i] = fitted[-1].to(out.dtype)
    return out


def concordance_readings(primary: torch.Tensor, auxiliary: torch.Tensor, pass_threshold: float) -> list[float]:
    """CONCUR-A's readings of one group: for every pair of passing responses (primary >= threshold) with different
    primary and different raw auxiliary reward, +1 when the auxiliary orders them like the primary, -1 otherwise."""
    passing = [i for i in range(len(primary)) if primary[i].item() >= pass_threshold]
    readings = []
    for a, i in enumerate(passing):
        for j in passing[a + 1 :]:
            dp = primary[i].item() - primary[j].item()
            da = auxiliary[i].item() - auxiliary[j].item()
            if dp != 0 and da != 0:
                readings.append(1.0 if (dp > 0) == (da > 0) else -1.0)
    return readings


@dataclass
class ConcurTrust:
    """Cumulative concordance readings of one auxiliary reward (CONCUR-A's batch-level trust state).

    The ceiling tie is released while at least ``min_readings`` readings have a mean above twice its standard
    error, and bound again if the mean falls back (the readings are not i.i.d., so this is a fixed rule, not a
    significance test).
    """

    count: int = 0
    total: float = 0.0
    total_squares: float = 0.0
    min_readings: int = CONCUR_MIN_READINGS

    def update(self, readings: list[float]) -> None:
        self.count += len(readings)
        self.total += sum(readings)
        self.total_squares += sum(r * r for r in readings)

    def tie_ceiling(self) -> bool:
        if self.count < self.min_readings:
            return True
        mean = self.total / self.count
        variance = max(self.total_squares / self.count - mean**2, 0.0) * self.count / (self.count - 1)
        return not mean > 2.0 * math.sqrt(variance / self.count)


def concur_advantages(
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    num_generations: int,
    primary: int,
    pass_threshold: float,
    ceiling: float,
    ceiling_mode: str,
    trust: dict[int, ConcurTrust] | None = None,
    min_readings: int = CONCUR_MIN_READINGS,
) -> torch.Tensor:
    """CONCUR on a whole batch: gate, standardise, project each auxiliary reward per group.

    1. Gate: an auxiliary reward counts only for passing responses (primary >= ``pass_threshold``); failing ones get
       0 before group standardisation.
    2. Standardise every gated auxiliary reward per group (docs/method.md step 1).
    3. Trust (``ceiling_mode="adaptive"``): merge every group's readings of this batch into ``trust`` first, then
       decide once for the whole batch whether the ceiling is tied; ``"tie"`` always ties, ``"none"`` never does.
    4. Project each group's auxiliary advantages onto the primary order (:func:`concur_project`).

    Args:
        rewards: ``[N, K]`` raw rewards (NaN: not applicable); advantages: ``[N, K]`` group advantages.
        primary: index of the primary reward, whose advantages are returned unchanged.
        trust: per auxiliary index, the state updated in place (required for ``"adaptive"``); new states need
            ``min_readings`` readings before they may release the tie.

    Returns:
        ``[N, K]`` advantages with the auxiliary columns projected.
    """
    if ceiling_mode not in CONCUR_CEILING_MODES:
        raise ValueError(f"ceiling_mode must be 'tie', 'adaptive' or 'none', got {ceiling_mode!r}")
    if ceiling_mode == "adaptive" and trust is None:
        raise ValueError("ceiling_mode='adaptive' needs a trust state")
    primary_rewards = torch.nan_to_num(rewards[:, primary], nan=0.0)
    passing = primary_rewards >= pass_threshold
    out = advantages.clone()
    groups = range(0, rewards.shape[0], num_generations)
    for k in range(rewards.shape[1]):
        if k == primary:
            continue
        gated = rewards[:, k].where(passing | rewards[:, k].isnan(), 0.0)  # NaN (not applicable) stays NaN
        gated_adv, _ = group_advantages(gated[:, None], num_generations)
        tie = ceiling_mode == "tie"
        if ceiling_mode == "adaptive":
            state = trust.setdefault(k, ConcurTrust(min_readings=min_readings))
            for g in groups:
                rows = slice(g, g + num_generations)
                state.update(concordance_readings(primary_rewards[rows], rewards[rows, k], pass_threshold))
            tie = state.tie_ceiling()
        for g in groups:
            rows = slice(g, g + num_generations)
            out[rows, k] = concur_project(primary_rewards[rows], gated_adv[rows, 0], tie, ceiling)
    return out
