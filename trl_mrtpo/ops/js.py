"""The Jensen-Shannon terms of the replay divergence in fp32 and log space (docs/method.md step 4), shared by every
torch path: a leaf of the ops room."""

from __future__ import annotations

import torch

from ..constants import LN2, MAX_LOG_RATIO


def js_divergence(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """Step 4: ``JS(p || q) / ln 2`` over the last (vocabulary) dimension, clamped to [0, 1].

    Each vocabulary entry is written around the larger of its two probabilities, ``b = max(p, q)``, with
    ``a = |log p - log q|`` and ``u = exp(-a)`` (so the smaller one is ``b u`` and ``m = b (1 + u) / 2``):

        ``JS = 1/2 sum b ((1 + u)(ln 2 - log1p(u)) - u a)``

    This is exactly 0 on identical inputs (``log1p(1)`` is ``ln 2``), agrees with float64 to ~1e-7 bits even where
    one distribution moves most of its mass onto tokens the other finds unlikely (no ``d + ln 2 - softplus(d)``
    cancellation), and needs two ``exp`` and one ``log1p`` per entry (the ``log1p(0.5 * expm1(.))`` form needs
    more passes for the same accuracy). ``a`` is clamped to 100 so zero-probability (-inf) entries contribute their
    exact limit instead of NaN.

    Args:
        logprobs_p, logprobs_q: log-probabilities (normalised), broadcastable, ``[..., V]``.

    Returns:
        ``[...]`` divergence in bits.
    """
    return ((0.5 / LN2) * js_terms(logprobs_p, logprobs_q)).clamp_(0.0, 1.0)


def js_terms(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """``sum_v b ((1 + u)(ln 2 - log1p(u)) - u a)`` over the last dimension (twice JS in nats, before the clamp): a
    sum over vocabulary entries, so vocabulary tiles add up."""
    # In-place steps: at most three vocabulary-sized temporaries are alive at once (replay memory is bounded by them).
    gap = (logprobs_q - logprobs_p).nan_to_num_(0.0, MAX_LOG_RATIO, -MAX_LOG_RATIO).abs_().clamp_(max=MAX_LOG_RATIO)
    smaller_share = gap.neg().exp_()  # u = min(p, q) / max(p, q)
    terms = torch.log1p(smaller_share).neg_().add_(LN2)  # log b - log m
    terms.addcmul_(terms, smaller_share).sub_(smaller_share.mul_(gap))  # (1 + u)(log b - log m) - u a
    del gap, smaller_share
    larger = torch.maximum(logprobs_p, logprobs_q).exp_()
    return larger.mul_(terms).sum(-1)


def softcapped_(logits: torch.Tensor, softcap: float | None, temperature: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap) / temperature`` in place (the logits as the model's forward, then sampling,
    transform them); only the division when ``softcap`` is None."""
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits.div_(temperature) if temperature != 1.0 else logits
