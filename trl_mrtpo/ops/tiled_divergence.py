"""The torch path of the replay divergence for a low-precision lm_head (bf16, fp16) off CUDA (docs/method.md step 4):
vocabulary tiles cast to fp32 one at a time. Loaded only where it runs."""

from __future__ import annotations

import math

import torch

from ..constants import DEFAULT_CHUNK_ELEMENTS, LN2, MIN_CHUNK_TOKENS, VOCAB_TILE
from .js import js_terms, softcapped_


def tiled_divergence(
    stacked: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """The torch path for a low-precision lm_head (bf16, fp16): fp32 logits from vocabulary tiles of
    :data:`VOCAB_TILE` rows cast to fp32 one at a time, in two passes over the tiles (each context's log-normaliser,
    then the JS terms tile by tile, which add up over the vocabulary). The extra memory is one fp32 tile and
    ``[M + 1, tokens, tile]`` logits, never ``V x H`` in fp32; each tile is cast twice per call. Logits are never
    rounded to the weight's dtype."""
    num_tokens, contexts = stacked.shape[:2]
    vocab, device = lm_head_weight.shape[0], stacked.device
    tokens = max(MIN_CHUNK_TOKENS, DEFAULT_CHUNK_ELEMENTS // (contexts * VOCAB_TILE))

    def tiled_logits():
        """``(token rows, [M + 1, rows, tile] fp32 logits)``, one tile's weight cast at a time, one chunk alive."""
        for start in range(0, vocab, VOCAB_TILE):
            weight = lm_head_weight[start : start + VOCAB_TILE].float()
            bias = None if lm_head_bias is None else lm_head_bias[start : start + VOCAB_TILE].float()
            for first in range(0, num_tokens, tokens):
                rows = slice(first, min(first + tokens, num_tokens))
                chunk = stacked[rows].transpose(0, 1).contiguous().float()
                yield rows, softcapped_(torch.nn.functional.linear(chunk, weight, bias), softcap, temperature)

    normaliser = torch.full((contexts, num_tokens), -math.inf, device=device)
    for rows, logits in tiled_logits():
        normaliser[:, rows] = torch.logaddexp(normaliser[:, rows], torch.logsumexp(logits, dim=-1))
    total = torch.zeros(contexts - 1, num_tokens, dtype=torch.float32, device=device)
    for rows, logits in tiled_logits():
        logprobs = logits.sub_(normaliser[:, rows, None])
        total[:, rows] += js_terms(logprobs[0], logprobs[1:])
    return ((0.5 / LN2) * total).clamp_(0.0, 1.0)
