"""Pure tensor maths of the research room (docs/method.md, "Sibling methods" and "Calibrated credit"): the
``shuffled`` ablation, CoRT's and TACO's token weights, and the calibrated-credit options that stayed options
(null correction, preserved reward totals).

Every function takes tensors and returns tensors; shapes as in :mod:`trl_mrtpo.credit`.
"""

from __future__ import annotations

import math

import torch

from ..credit import (
    ROUNDING_MOMENT,
    ReduceSum,
    TokenCredit,
    batch_rescale,
    batch_std,
    summed_over_processes,
    without_masked_penalties,
)


def shuffle_relevance(
    relevance: torch.Tensor, mask: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Ablation ``shuffled``: permute each profile's q values among its own completion positions.

    Args:
        relevance: ``[B, K, C]`` q profiles.
        mask: ``[B, C]`` completion mask.
    """
    out = relevance.clone()
    for b in range(relevance.shape[0]):
        positions = mask[b].bool().nonzero(as_tuple=True)[0]
        for k in range(relevance.shape[1]):
            perm = torch.randperm(positions.numel(), generator=generator, device="cpu").to(positions.device)
            out[b, k, positions] = relevance[b, k, positions[perm]]
    return out


def preserved_token_advantages(
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    reward_weights: torch.Tensor,
    max_second_moment_ratio: float | None,
    reduce_sum: ReduceSum | None = None,
    process: torch.Tensor | None = None,
    failure_suffix: torch.Tensor | None = None,
) -> TokenCredit:
    """Steps 6-8 with every reward's total kept (docs/method.md, "Calibrated credit", preserved totals).

    Each reward is capped on its own: ``S = U + sum_k s_k R_k`` with ``R_{k,t} = c_k A_k (w_{k,t} - 1)`` and
    ``s_k = min(1, sqrt((rho - 1) sum_j T_j (c_k A_k)^2 / sum_{j,t} R_{k,j,t}^2))``; the batch rescale divides by
    ``std_B(U)``, the std of uniform spreading, not by ``std_B(S)``. Invariant: for every response j and reward k the
    tokens carry exactly ``T_j c_k A_k / std_B(U)`` of that reward in total, what GDPO gives it; each reward's
    redistributed second moment is at most ``rho - 1`` times its own uniform one. ``process`` and ``failure_suffix``
    join as in :func:`weighted_token_advantages`; the rescale's std is then that of ``U`` plus the process part.

    Returns:
        :class:`TokenCredit` whose ``cap_factor`` is the smallest ``s_k``.
    """
    dtype, advantages = advantages.dtype, advantages.double()  # float64 until the rescale, as above
    mask_f = mask.to(advantages)
    scaled = advantages * reward_weights.to(advantages)
    uniform = scaled.sum(-1)
    redistributed = scaled[..., None] * (weights.to(advantages) - 1.0) * mask_f[:, None, :]
    num_rewards = scaled.shape[-1]
    factors = torch.ones(num_rewards, dtype=torch.float64, device=scaled.device)
    if max_second_moment_ratio is not None:
        lengths = mask_f.sum(-1).double()
        moments = summed_over_processes(
            [*(lengths[:, None] * scaled.double() ** 2).sum(0), *(redistributed.double() ** 2).sum((0, 2))],
            reduce_sum,
        )
        uniform_moments, redistributed_moments = moments[:num_rewards], moments[num_rewards:]
        spread = redistributed_moments > ROUNDING_MOMENT * uniform_moments
        headroom = max(max_second_moment_ratio - 1.0, 0.0) * uniform_moments
        ratio = headroom / torch.where(spread, redistributed_moments, 1.0)
        factors = torch.where(spread, ratio.sqrt().clamp(max=1.0), factors)
    scores = (uniform[:, None] + (factors.to(scaled)[None, :, None] * redistributed).sum(1)) * mask_f
    baseline = uniform[:, None] * mask_f
    if process is not None:
        scores, baseline = scores + process.to(scores) * mask_f, baseline + process.to(scores) * mask_f
    std = batch_std(baseline, mask, reduce_sum)
    scores = without_masked_penalties(scores, scaled, weights, factors.to(scaled), mask_f, failure_suffix)
    return TokenCredit(
        batch_rescale(scores, mask, reduce_sum, std).to(dtype), weights, float(factors.min()), std or 1.0
    )


def null_corrected_relevance(
    relevance: torch.Tensor, replayed: torch.Tensor, groups: torch.Tensor | None = None
) -> torch.Tensor:
    """Null-corrected q (docs/method.md, "Calibrated credit"): each replayed profile minus the pointwise minimum of
    the other replayed profiles of the same response, floored at 0; a reward's twins (its information group's other
    members, ``groups`` ``[B, K]``, None: each reward its own) are not others.

    Removing any block perturbs the same early, uncertain tokens: what every removal of a response shares is that
    background, and what stands above it is specific to the reward. No extra forward: the control is the other
    rewards' replays. A profile with no other replayed profile in its response is returned unchanged.

    Args:
        relevance: ``[B, K, C]`` q profiles.
        replayed: ``[B, K]`` bool, the profiles that hold a replay.
    """
    others = torch.where(replayed[..., None], relevance, torch.full_like(relevance, math.inf))
    corrected = relevance.clone()
    for k in range(relevance.shape[1]):
        rest = torch.cat([others[:, :k], others[:, k + 1 :]], dim=1)
        if rest.shape[1] == 0:
            break
        if groups is not None:  # the twins' profiles are the reward's own
            twins = torch.cat([groups[:, :k], groups[:, k + 1 :]], dim=1) == groups[:, k, None]
            rest = rest.masked_fill(twins[..., None], math.inf)
        control = rest.amin(dim=1)
        has_control = torch.isfinite(control) & replayed[:, k, None]
        corrected[:, k] = torch.where(has_control, (relevance[:, k] - control).clamp(min=0.0), relevance[:, k])
    return corrected


def cort_weights(
    contrast: torch.Tensor, mask: torch.Tensor, strength: float, sharpness: float = 1.0, offset: float = 0.0
) -> torch.Tensor:
    """CoRT token weights (docs/method.md, modes, ``cort``) from the sampled tokens' log-likelihood contrast.

    ``s_t = sigmoid(tau (delta_t - b)) - 1/2``, ``w~_t = 1 + eta lambda_n s_t``, normalised to mean 1 over each
    response's tokens, where ``delta_t = log pi(y_t | with criteria) - log pi(y_t | without)``.

    Args:
        contrast: ``[B, C]`` delta.
        mask: ``[B, C]`` completion mask.
        strength: ``eta * lambda_n`` in [0, 2): weights before normalisation lie in ``[1 - strength/2,
            1 + strength/2]``, so they stay positive.
        sharpness: tau; offset: b.

    Returns:
        ``[B, C]`` weights, mean exactly 1 per response, 1 on padded positions.
    """
    if not 0.0 <= strength < 2.0:
        raise ValueError(f"CoRT strength (eta * lambda) must be in [0, 2) to keep weights positive, got {strength}")
    mask = mask.to(contrast.dtype)
    raw = 1.0 + strength * (torch.sigmoid(sharpness * (contrast - offset)) - 0.5)
    mean = (raw * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    return torch.where(mask.bool(), raw / mean, torch.ones_like(raw))


def taco_scale(
    advantages: torch.Tensor, surprisal: torch.Tensor, strength: float, threshold: float, sharpness: float
) -> torch.Tensor:
    """TACO-style calibration: positive token advantages shrink smoothly on high-risk (surprising) tokens.

    ``A_t <- A_t (1 - strength * sigmoid(sharpness (surprisal_t - threshold)))`` where ``A_t > 0``; non-positive
    advantages are untouched (failures keep their full penalty). The factor lies in ``[1 - strength, 1]``.

    Args:
        advantages: ``[B, C]`` token advantages.
        surprisal: ``[B, C]`` ``-log pi_old(y_t)`` of the sampled tokens, our proxy for TACO's tail risk.
        strength: in [0, 1]; 0 leaves everything unchanged.
    """
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"TACO strength must be in [0, 1], got {strength}")
    factor = 1.0 - strength * torch.sigmoid(sharpness * (surprisal - threshold))
    return torch.where(advantages > 0, advantages * factor, advantages)
