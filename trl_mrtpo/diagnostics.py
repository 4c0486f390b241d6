"""Records and statistics of where relevance q lands (training metrics, inspection)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def mass_share(relevance: torch.Tensor, mass: float = 0.8) -> float:
    """Share of a profile's tokens that hold ``mass`` of its q mass (the smallest such set).

    1/L means one token holds it all; ``mass`` means q is spread evenly. NaN for an all-zero profile.
    """
    values = relevance.flatten().float()
    total = values.sum()
    if values.numel() == 0 or total <= 0:
        return float("nan")
    cumulative = values.sort(descending=True).values.cumsum(0)
    needed = int(torch.searchsorted(cumulative, mass * total).item()) + 1
    return min(needed, values.numel()) / values.numel()


class CollapseMonitor:
    """Counts, per reward, consecutive steps whose replayed q mass is near zero.

    Near-zero q everywhere means the weights fall back to uniform: the run is silently plain GDPO for that reward.
    :meth:`update` returns the rewards that have just reached ``patience`` such steps (each reported once per run of
    collapsed steps).
    """

    def __init__(self, patience: int, threshold: float = 1e-6):
        self.patience = patience
        self.threshold = threshold
        self.streaks: dict[str, int] = {}

    def update(self, mean_relevance: dict[str, float]) -> list[str]:
        alarms = []
        for name, value in mean_relevance.items():
            streak = self.streaks.get(name, 0) + 1 if value < self.threshold else 0
            self.streaks[name] = streak
            if streak == self.patience:
                alarms.append(name)
        return alarms


@dataclass
class CreditRecord:
    """Everything credit assignment produced for one local generation batch (``B`` responses, ``K`` rewards)."""

    prompts: list
    completions: list[str]
    completion_ids: torch.Tensor  # [B, C]
    mask: torch.Tensor  # [B, C]
    rewards: torch.Tensor  # [B, K], NaN = None
    group_advantages: torch.Tensor  # [B, K] A_k
    relevance: torch.Tensor  # [B, K, C] q (0 where not replayed)
    replayed: torch.Tensor  # [B, K]
    weights: torch.Tensor  # [B, K, C] w
    advantages: torch.Tensor  # [B, C] final token advantages
    beta: float
