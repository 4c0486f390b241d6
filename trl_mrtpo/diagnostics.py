"""Statistics of where relevance q lands, for the ``mrtpo/`` training metrics."""

from __future__ import annotations

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
