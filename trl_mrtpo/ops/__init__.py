"""Divergence kernels for the replay (DESIGN.md §1 step 4). One public entry point: :func:`replay_divergence`."""

from .divergence import js_divergence, replay_divergence

__all__ = ["js_divergence", "replay_divergence"]
