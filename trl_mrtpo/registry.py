"""Names the ``trl-mrtpo train`` command and recipes use for reward functions, info blocks and data loaders."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable


def _kit_entries() -> tuple[dict[str, Callable], dict[str, Callable]]:
    from .demo import DEMO_TASKS, task_kit

    kits = [task_kit(task) for task in DEMO_TASKS]
    rewards = {f.__name__: f for reward_funcs, _ in kits for f in reward_funcs}
    blocks = {b.__name__: b for _, info_blocks in kits for b in info_blocks if b is not None}
    return rewards, blocks


def resolve(name: str, kind: str) -> Callable | None:
    """A reward function (``kind="reward"``) or info-block builder (``kind="info_block"``) by registry name or
    dotted import path (``my_pkg.rewards.my_reward``, resolved from the working directory too). ``"none"`` gives
    None (a reward without an info block)."""
    if kind == "info_block" and name.lower() == "none":
        return None
    rewards, blocks = _kit_entries()
    registry = rewards if kind == "reward" else blocks
    if name in registry:
        return registry[name]
    if "." in name:
        module_path, attribute = name.rsplit(".", 1)
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            return getattr(importlib.import_module(module_path), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot import {kind} {name!r}: {error}") from error
    raise ValueError(f"unknown {kind} {name!r}: use a dotted import path or one of {', '.join(sorted(registry))}")
