"""Jensen-Shannon divergence between next-token distributions, in fp32 and log space (DESIGN.md §1 step 4)."""

from __future__ import annotations

import math

import torch

LN2 = math.log(2.0)
# Elements of [contexts, tokens, vocab] fp32 logits per chunk (~8 MB): bounds replay memory; on CPU small chunks were
# also faster than large ones (benchmarks/js_kernel.py: 2^20 elements 5.8 s, 2^25 11.8 s at V=49152, K=3).
DEFAULT_CHUNK_ELEMENTS = 1 << 21


def js_divergence(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """Step 4: ``JS(p || q) / ln 2`` over the last (vocabulary) dimension, clamped to [0, 1].

    ``log m`` is computed as ``max(lp, lq) + log1p(0.5 * expm1(-|lp - lq|))``, which is exactly 0 divergence on
    identical inputs (``logaddexp`` leaves ~2e-7 bits of fp32 rounding there). Zero-probability entries
    contribute 0.

    Args:
        logprobs_p, logprobs_q: log-probabilities (normalised), broadcastable, ``[..., V]``.

    Returns:
        ``[...]`` divergence in bits.
    """
    lp, lq = torch.broadcast_tensors(logprobs_p, logprobs_q)
    gap = (lp - lq).abs().nan_to_num(nan=0.0)  # both -inf -> gap 0
    log_m = torch.maximum(lp, lq) + torch.log1p(0.5 * torch.expm1(-gap))

    def half_kl(logprobs: torch.Tensor) -> torch.Tensor:
        probs = logprobs.exp()
        terms = torch.where(probs > 0, probs * (logprobs - log_m), torch.zeros_like(probs))
        return terms.sum(-1)

    return ((0.5 * half_kl(lp) + 0.5 * half_kl(lq)) / LN2).clamp(0.0, 1.0)


def replay_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-token relevance ``q[m, t] = JS(p_all_t || p_not_m_t) / ln 2`` from last hidden states.

    The ``M + 1`` contexts of a token chunk go through the shared lm_head in one matmul, in fp32, and ``P_all``'s
    log-softmax is computed once and shared by every removed context. Only one chunk of ``[M + 1, chunk, V]``
    logits exists at a time, so memory is bounded by the chunk, not by the sequence.

    Args:
        hidden_all: ``[N, H]`` last hidden states at the N completion positions after ``P_all``.
        hidden_removed: ``[M, N, H]`` the same positions after each ``P_not_m``.
        lm_head_weight: ``[V, H]``; lm_head_bias: ``[V]`` or None.
        temperature: sampling temperature; logits are divided by it.
        chunk_size: tokens per chunk; default keeps ``(M + 1) * chunk * V`` near 2M elements.

    Returns:
        ``[M, N]`` fp32 relevance in [0, 1].
    """
    if hidden_removed.dim() != 3 or hidden_removed.shape[1:] != hidden_all.shape:
        raise ValueError(
            f"hidden_removed must be [M, N, H] matching hidden_all {tuple(hidden_all.shape)}, "
            f"got {tuple(hidden_removed.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    num_removed, num_tokens = hidden_removed.shape[:2]
    vocab = lm_head_weight.shape[0]
    if chunk_size is None:
        chunk_size = max(1, DEFAULT_CHUNK_ELEMENTS // ((num_removed + 1) * vocab))
    weight = lm_head_weight.float()
    bias = None if lm_head_bias is None else lm_head_bias.float()
    out = torch.empty(num_removed, num_tokens, dtype=torch.float32, device=hidden_all.device)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        stacked = torch.cat([hidden_all[None, start:end], hidden_removed[:, start:end]]).float()
        logits = torch.nn.functional.linear(stacked, weight, bias)
        if temperature != 1.0:
            logits = logits / temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        out[:, start:end] = js_divergence(logprobs[:1], logprobs[1:])
    return out
