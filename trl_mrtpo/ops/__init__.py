"""Kernels of the replay (docs/method.md step 4): the JS divergence, torch and the named backends (the fused Triton
kernel among them) behind one entry point, :func:`replay_divergence`."""

from .divergence import replay_divergence
from .js import js_divergence

__all__ = ["js_divergence", "replay_divergence"]
