"""Kernels of the replay (docs/method.md step 4): the JS divergence (torch and fused Triton backends behind one entry
point, :func:`replay_divergence`) and per-token scores of sampled tokens."""

from . import triton_divergence  # noqa: F401  registers the "triton" divergence backend
from .divergence import js_divergence, replay_divergence
from .token_scores import sampled_logprobs, self_certainty

__all__ = ["js_divergence", "replay_divergence", "sampled_logprobs", "self_certainty"]
