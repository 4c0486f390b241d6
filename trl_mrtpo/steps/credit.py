"""Pure tensor maths of step-level credit (docs/method.md, "Process rewards and failure-suffix masking"): GRPO's
process-supervision rule and the failure-suffix mask. Shapes as in :mod:`trl_mrtpo.credit`."""

from __future__ import annotations

import torch

from ..credit import GROUP_STD_EPS, nan_std


def process_advantages(
    step_scores: torch.Tensor, step_ends: torch.Tensor, num_generations: int, num_positions: int
) -> torch.Tensor:
    """Process supervision (docs/method.md, "Process rewards"): GRPO's rule for step-level rewards.

    Every step score of a prompt group is normalised by the mean and the std (Bessel) over all step scores of the
    group's responses, ``r~ = (r - mean) / (std + eps)`` with step 1's epsilon; token ``t`` of a response gets the sum
    of the normalised scores of its steps that end at or after ``t``. A group whose step scores are all equal (or
    that has fewer than two) gets 0, as a constant outcome reward does.

    Args:
        step_scores: ``[B, S]`` scores, NaN where a response has fewer than ``S`` steps. Consecutive blocks of
            ``num_generations`` rows form one prompt group.
        step_ends: ``[B, S]`` the completion position of each step's last token (ignored where the score is NaN).
        num_positions: ``C``, the completion length of the batch.

    Returns:
        ``[B, C]`` float64 token process advantages; 0 after a response's last step.
    """
    if step_scores.shape != step_ends.shape or step_scores.dim() != 2:
        raise ValueError(
            f"step_scores {tuple(step_scores.shape)} and step_ends {tuple(step_ends.shape)} must both be [B, S]"
        )
    rows, steps = step_scores.shape
    if num_generations < 1 or rows % num_generations != 0:
        raise ValueError(f"{rows} rows cannot be split into groups of num_generations={num_generations}")
    grouped = step_scores.double().reshape(-1, num_generations * steps)
    present = ~torch.isnan(grouped)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nan_std(grouped, dim=1)
    highest = torch.where(present, grouped, float("-inf")).amax(dim=1, keepdim=True)
    lowest = torch.where(present, grouped, float("inf")).amin(dim=1, keepdim=True)
    varying = highest > lowest
    normalised = torch.where(present & varying, (grouped - mean) / (std + GROUP_STD_EPS), 0.0).reshape(rows, steps)
    positions = torch.arange(num_positions, device=step_scores.device)
    ends = torch.where(torch.isnan(step_scores), -1, step_ends.long())
    covers = ends[:, :, None] >= positions[None, None, :]  # [B, S, C]: step s ends at or after t
    return (normalised[:, :, None] * covers).sum(1)


def failure_suffix_mask(boundaries: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Failure-suffix masking (docs/method.md, "Failure-suffix masking"): ``[B, K, C]`` True on the positions after
    each (response, reward) pair's error boundary, the position of the last token of the last error the response did
    not recover from. A negative boundary marks a pair without one (nothing is masked)."""
    positions = torch.arange(num_positions, device=boundaries.device)
    marked = boundaries >= 0
    return marked[..., None] & (positions > boundaries[..., None])
