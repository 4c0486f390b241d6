"""Pure tensor maths of MRTPO credit assignment (docs/method.md, steps 1 and 5-9). Process rewards' and failure
suffixes' maths is in :mod:`trl_mrtpo.steps.credit`, the sibling methods' in :mod:`trl_mrtpo.research.credit`.

Nothing here knows about TRL or models: every function takes tensors and returns tensors, so each step can be
checked against a hand-worked example or a float64 reference.

Shapes: ``B`` responses in the local batch, ``K`` rewards, ``C`` completion positions (right-padded, ``mask`` is 1
on real tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

ReduceSum = Callable[[torch.Tensor], torch.Tensor]  # sums a tensor over data-parallel processes

GROUP_STD_EPS = 1e-4  # same epsilon as TRL's normalize_then_sum
QBAR_FLOOR = 1e-8  # below this mean relevance a reward keeps uniform credit (step 5)
ROUNDING_MOMENT = 1e-12  # relative size of sum R^2 that fp32 rounding alone can produce


def nan_std(x: torch.Tensor, dim: int) -> torch.Tensor:
    """NaN-aware standard deviation with Bessel's correction (TRL's ``nanstd`` estimator); NaN when < 2 values."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    sq = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True)
    var = torch.where(count > 1, sq / (count - 1).clamp(min=1), torch.full_like(sq, float("nan")))
    return var.sqrt()


def group_advantages(
    rewards: torch.Tensor, num_generations: int, eps: float = GROUP_STD_EPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 1: per-reward group normalisation (GDPO).

    Args:
        rewards: ``[N, K]`` rewards, NaN where a reward does not apply. Consecutive blocks of ``num_generations``
            rows form one prompt group (TRL's ordering).
        num_generations: group size G.

    Returns:
        ``(advantages, varying)``: ``advantages[N, K] = (r - mean_k) / (std_k + eps)`` with NaN-aware group
        statistics and NaN counted as 0; ``varying[N, K]`` is True where reward k is not constant in the row's group
        (its non-NaN values are not all equal), the precondition of a replay (step 3). Constancy is decided by
        equality, not by ``std > 0``: fp32 rounding gives eight equal fractional values a std of ~1e-8, which the
        batch rescale would blow up to order 1. A constant group, and a reward that is None for a whole group, get
        exactly zero advantage and are never replayed.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [N, K], got shape {tuple(rewards.shape)}")
    n, k = rewards.shape
    if num_generations < 1 or n % num_generations != 0:
        raise ValueError(f"{n} rows cannot be split into groups of num_generations={num_generations}")
    # float64: the squares of user-scale rewards (1e19 and beyond) overflow float32
    grouped = rewards.double().view(-1, num_generations, k)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = nan_std(grouped, dim=1)
    missing = torch.isnan(grouped)
    highest = torch.where(missing, float("-inf"), grouped).amax(dim=1, keepdim=True)
    lowest = torch.where(missing, float("inf"), grouped).amin(dim=1, keepdim=True)
    varying = (highest > lowest).expand_as(grouped)  # False for all-NaN groups too (-inf > inf is False)
    advantages = torch.where(varying, torch.nan_to_num((grouped - mean) / (std + eps), nan=0.0), 0.0)
    return advantages.reshape(n, k).to(rewards.dtype), varying.reshape(n, k)


def warmup_steps(value: float, max_steps: int) -> float:
    """Step 9's ``N``: ``value`` steps, or for ``0 < value < 1`` that share of ``max_steps`` (rounded up), as
    transformers reads ``warmup_steps``."""
    return math.ceil(value * max_steps) if 0 < value < 1 and max_steps > 0 else value


def short_run_warning(max_steps: int, configured: float, steps: float, beta: float) -> str:
    """What a run shorter than twice its warm-up is told: the beta of its last step (sampled at global step
    ``max_steps - 1``), and a warm-up that fits in half the run (none when that is under one step)."""
    reached = warmup_beta(beta, max_steps - 1, steps)
    half = max_steps // 2
    share = " (or a share such as 0.25)" if math.ceil(0.25 * max_steps) <= half else ""
    advice = f"to at most {half}{share}" if half else "=0 (no warm-up)"
    return (
        f"max_steps={max_steps} is under twice credit_warmup_steps={configured:g}: beta reaches {reached:.2g} of "
        f"{beta:g} by the last step, so token credit is weaker than configured for most of the run. Set "
        f"credit_warmup_steps{advice} for a short run."
    )


def warmup_beta(beta: float, step: int, warmup_steps: float) -> float:
    """Step 9: ``beta_n = beta * (3u^2 - 2u^3)`` with ``u = min(n / N, 1)``; no warm-up when ``N <= 0``."""
    if warmup_steps <= 0:
        return float(beta)
    u = min(max(step, 0) / warmup_steps, 1.0)
    return float(beta * (3 * u**2 - 2 * u**3))


def read_relevance(relevance: torch.Tensor, replayed: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Step 4's q as the method reads it, from any relevance provider: 0 off the replayed pairs' tokens (padding,
    tool results, pairs not replayed), and rounding below 0 (a provider's [-1e-6, 0)) read as 0.

    Args:
        relevance: ``[B, K, C]`` q as the provider returned it.
        replayed: ``[B, K]`` bool, the pairs replayed.
        mask: ``[B, C]`` the credit mask.
    """
    read = replayed[..., None] & mask[:, None, :].bool()
    return relevance.masked_fill(~read, 0.0).clamp(min=0.0)


def token_weights(relevance: torch.Tensor, mask: torch.Tensor, beta: float | torch.Tensor) -> torch.Tensor:
    """Step 5: ``w_t = (1 - beta) + beta * q_t / qbar`` per response (and per reward on leading dims).

    Args:
        relevance: ``[..., C]`` per-token relevance q in [0, 1].
        mask: ``[..., C]`` (broadcastable) completion mask.
        beta: redistribution strength in [0, 1], a number or a tensor broadcastable to ``[..., 1]`` (``[K, 1]``
            for ``[B, K, C]`` relevance: one per reward).

    Returns:
        ``[..., C]`` weights: mean exactly 1 over each response's tokens, at least ``1 - beta`` everywhere; 1 where the
        response's mean relevance is below ``1e-8`` (no information: the reward's credit is kept, never dropped) and
        on padded positions.
    """
    mask = mask.to(relevance.dtype).expand_as(relevance)
    q = relevance * mask
    qbar = q.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
    informative = qbar >= QBAR_FLOOR
    w = (1 - beta) + beta * q / torch.where(informative, qbar, torch.ones_like(qbar))
    return torch.where(informative & mask.bool(), w, torch.ones_like(w))


def relevance_specificity(
    relevance: torch.Tensor,
    replayed: torch.Tensor,
    reduce_sum: ReduceSum | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Step 5's strength reading: ``[K]`` float64, how much each reward's q stands out from the control in this batch:
    the mean, over its replayed responses with another replayed information group, of ``1 - cos(q_k, control)`` in
    [0, 1], the control being the mean of one profile per other replayed group of the response (0: q_k has the shape
    of what every removal perturbs; 1: it lies where no other removal reaches). A reward's twins (its group's other
    members, whose q is its own) are never its control. Profiles without mass give no reading; NaN for a reward
    without any reading. With ``reduce_sum`` the mean is over every process's responses, so all ranks read alike.

    Args:
        relevance: ``[B, K, C]`` q profiles.
        replayed: ``[B, K]`` bool.
        groups: ``[B, K]`` each reward's information group (None: each reward its own).
    """
    relevance = relevance.double()  # 1 - cos of near-parallel profiles cancels: float32 would keep ~3 digits
    if groups is None:
        groups = torch.arange(replayed.shape[1], device=replayed.device).expand(replayed.shape)
    same = groups[:, :, None] == groups[:, None, :]  # [B, K, K']
    earlier = torch.ones_like(same[0]).tril(-1)  # k' < k
    carrier = replayed & ~(same & earlier & replayed[:, None, :]).any(-1)  # each replayed group's first member
    weight = carrier.to(relevance.dtype)[..., None]
    total = (relevance * weight).sum(1, keepdim=True)
    own_group = torch.einsum("bkj,bjc->bkc", (same & carrier[:, None, :]).to(relevance.dtype), relevance)
    others = carrier.sum(-1, keepdim=True) - (same & carrier[:, None, :]).sum(-1)  # other replayed groups
    control = (total - own_group) / others.clamp(min=1)[..., None]
    norms = relevance.norm(dim=-1) * control.norm(dim=-1)
    cosine = (relevance * control).sum(-1) / norms.clamp(min=1e-30)
    # in [0, 1] by construction (non-negative profiles); rounding of parallel profiles may leave -1e-16
    dissimilarity = torch.where(control.norm(dim=-1) > 0, (1.0 - cosine).clamp(0.0, 1.0), torch.ones_like(cosine))
    read = replayed & (others > 0) & (relevance.sum(-1) > 0)
    summed = torch.where(read, dissimilarity, torch.zeros_like(dissimilarity)).sum(0)
    totals = summed_over_processes([*summed, *read.sum(0)], reduce_sum)
    summed, count = totals[: relevance.shape[1]], totals[relevance.shape[1] :]
    return torch.where(count > 0, summed / count.clamp(min=1), torch.full_like(summed, math.nan))


def reward_strength(running_specificity: torch.Tensor, floor: float) -> torch.Tensor:
    """Step 5's per-reward strength: ``[K]`` ``g_k = clip(m_k / floor - 1, 0, 1)`` of a running specificity ``m_k``
    (:func:`relevance_specificity`): 0 at or below ``floor``, 1 from twice the floor; 1 where there is no reading yet
    (NaN). Reward k's beta is ``beta_n * g_k``."""
    strength = (running_specificity / floor - 1.0).clamp(0.0, 1.0)
    return torch.where(torch.isnan(running_specificity), torch.ones_like(strength), strength)


def combine(
    advantages: torch.Tensor, weights: torch.Tensor, reward_weights: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 6: ``S_t = sum_k c_k A_k w_{k,t}``, split into uniform ``U`` and redistributed ``R = S - U``.

    Args:
        advantages: ``[B, K]`` per-reward advantages A_k.
        weights: ``[B, K, C]`` token weights w_{k,t}.
        reward_weights: ``[K]`` reward weights c_k.
        mask: ``[B, C]`` completion mask.

    Returns:
        ``(uniform [B], redistributed [B, C])``; ``redistributed`` is 0 on padded positions and sums to 0 over
        each response whose weights average 1.
    """
    scaled = advantages * reward_weights.to(advantages)
    uniform = scaled.sum(-1)
    summed = torch.einsum("bk,bkc->bc", scaled, weights.to(advantages))
    return uniform, (summed - uniform[:, None]) * mask.to(advantages)


def summed_over_processes(values: list[torch.Tensor], reduce_sum: ReduceSum | None) -> torch.Tensor:
    """The given scalars in float64, summed over processes when ``reduce_sum`` is given."""
    stacked = torch.stack([v.double() for v in values])
    return reduce_sum(stacked) if reduce_sum is not None else stacked


def cap_redistribution(
    uniform: torch.Tensor,
    redistributed: torch.Tensor,
    mask: torch.Tensor,
    max_second_moment_ratio: float,
    reduce_sum: ReduceSum | None = None,
) -> tuple[torch.Tensor, float]:
    """Step 7: ``S_t = U + s R_t`` with ``s = min(1, sqrt((rho - 1) sum_j T_j U_j^2 / sum R^2))``.

    Because R sums to 0 per response, the capped batch second moment ``sum S^2`` is at most ``rho`` times the
    uniform one ``sum_j T_j U_j^2``. A redistribution whose moment is below ``1e-12`` of the uniform one is rounding
    (e.g. one-token responses) and gets ``s = 1``. Under data parallelism ``reduce_sum`` sums both moments over
    the processes, so every rank uses the same s for the whole generation batch.

    Returns:
        ``(token_scores [B, C], s)``; padded positions are exactly 0.
    """
    mask = mask.to(uniform)
    lengths = mask.sum(-1)
    uniform_moment, redistributed_moment = summed_over_processes(
        [(lengths.double() * uniform.double() ** 2).sum(), (redistributed.double() ** 2).sum()], reduce_sum
    )
    # R below fp32 rounding of S (e.g. one-token responses, whose weights are exactly 1) is no redistribution.
    if redistributed_moment > ROUNDING_MOMENT * uniform_moment:
        ratio = max(max_second_moment_ratio - 1.0, 0.0) * uniform_moment.item() / redistributed_moment.item()
        s = min(1.0, math.sqrt(ratio))
    else:
        s = 1.0
    return (uniform[:, None] + s * redistributed) * mask, s


def batch_std(token_scores: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum | None = None) -> float | None:
    """The token-weighted std (Bessel) of ``token_scores`` over all completion tokens of the generation batch, in
    float64 and two passes; None when it is 0, undefined (fewer than 2 tokens) or not finite.

    Under data parallelism ``reduce_sum`` sums the token count and the (centred) sums over the processes: the std
    is the whole generation batch's, the same on every rank.
    """
    values = token_scores[mask.bool()].double()
    count, total = summed_over_processes([values.new_tensor(values.numel()), values.sum()], reduce_sum)
    if count < 2:
        return None
    (squares,) = summed_over_processes([((values - total / count) ** 2).sum()], reduce_sum)
    std = (squares / (count - 1)).sqrt().item()
    return std if math.isfinite(std) and std > 0 else None


def batch_rescale(
    token_scores: torch.Tensor, mask: torch.Tensor, reduce_sum: ReduceSum | None = None, std: float | None = None
) -> torch.Tensor:
    """Step 8: divide by the token-weighted std (Bessel) over all completion tokens (:func:`batch_std`), or by
    ``std`` when given; unscaled if that std is 0.

    No mean is subtracted (per-reward advantages are already centred per group). Padded positions are exactly 0.
    """
    mask = mask.bool()
    if std is None:
        std = batch_std(token_scores, mask, reduce_sum)
    if std is None:
        return torch.where(mask, token_scores, torch.zeros_like(token_scores))
    return torch.where(mask, token_scores / std, torch.zeros_like(token_scores))


@dataclass
class TokenCredit:
    """Result of steps 5-8 (:func:`weighted_token_advantages`)."""

    advantages: torch.Tensor  # [B, C] token advantages handed to TRL's loss
    weights: torch.Tensor  # [B, K, C] token weights w_{k,t}
    cap_factor: float  # s of step 7
    rescale: float = 1.0  # the std step 8 divided by (1: unscaled), which turns an added part into what the loss sees


def replayed_token_weights(
    relevance: torch.Tensor, replayed: torch.Tensor, mask: torch.Tensor, beta: float | torch.Tensor
) -> torch.Tensor:
    """Step 5 over the batch: ``[B, K, C]`` token weights of the replayed (response, reward) pairs, 1 elsewhere.

    Args:
        relevance: ``[B, K, C]`` q values; read only where ``replayed``.
        replayed: ``[B, K]`` bool, the replayed (response, reward) pairs.
        mask: ``[B, C]`` completion mask.
        beta: beta_n in effect, or a ``[K]`` tensor, one per reward.
    """
    if isinstance(beta, torch.Tensor):
        beta = beta.to(relevance)[:, None]
    weights = token_weights(relevance, mask[:, None, :], beta)
    return torch.where(replayed[..., None], weights, torch.ones_like(weights))


def weighted_token_advantages(
    advantages: torch.Tensor,
    weights: torch.Tensor,
    mask: torch.Tensor,
    reward_weights: torch.Tensor,
    max_second_moment_ratio: float | None,
    reduce_sum: ReduceSum | None = None,
    process: torch.Tensor | None = None,
    failure_suffix: torch.Tensor | None = None,
) -> TokenCredit:
    """Steps 6-8 for given ``[B, K, C]`` token weights: combine, cap (``None``: no cap), batch rescale.

    ``process`` (``[B, C]``, the weighted process advantages) is added to ``S`` after the cap, which bounds only the
    outcome rewards' redistribution, and before the rescale, whose std includes it. ``failure_suffix`` (``[B, K, C]``
    bool) drops, after the rescale's std is taken, each reward's negative credit on the positions it marks: nothing
    else changes, not the std, not positive credit, not the other rewards (docs/method.md, "Process rewards and
    failure-suffix masking").
    """
    # float64 until the rescale: c_k A_k summed over rewards can pass float32's range (weights near its maximum)
    dtype, advantages = advantages.dtype, advantages.double()
    uniform, redistributed = combine(advantages, weights, reward_weights, mask)
    if max_second_moment_ratio is None:
        scores, s = (uniform[:, None] + redistributed) * mask.to(uniform), 1.0
    else:
        scores, s = cap_redistribution(uniform, redistributed, mask, max_second_moment_ratio, reduce_sum)
    mask_f = mask.to(scores)
    if process is not None:
        scores = scores + process.to(scores) * mask_f
    std = batch_std(scores, mask, reduce_sum)
    scaled = advantages * reward_weights.to(advantages)
    factors = torch.full_like(scaled[0], s)
    scores = without_masked_penalties(scores, scaled, weights, factors, mask_f, failure_suffix)
    return TokenCredit(batch_rescale(scores, mask, reduce_sum, std).to(dtype), weights, s, std or 1.0)


def without_masked_penalties(
    scores: torch.Tensor,
    scaled: torch.Tensor,
    weights: torch.Tensor,
    factors: torch.Tensor,
    mask: torch.Tensor,
    failure_suffix: torch.Tensor | None,
) -> torch.Tensor:
    """``S`` less each reward's capped credit ``c_k A_k (1 + s_k (w_{k,t} - 1))`` where it is negative and
    ``failure_suffix`` marks the position."""
    if failure_suffix is None:
        return scores
    credit = scaled[..., None] * (1.0 + factors[None, :, None] * (weights.to(scaled) - 1.0))
    dropped = failure_suffix.bool() & (scaled[..., None] < 0)
    return scores - (torch.where(dropped, credit, torch.zeros_like(credit)).sum(1) * mask)
