"""The configuration's own checks, run by ``MRTPOConfig.__post_init__``: each field of its declared type, finite,
and in its range (docs/configuration.md). They read the configuration alone."""

from __future__ import annotations

import math
import numbers
import types
import typing
from collections.abc import Sequence
from typing import Any

import torch

from ..constants import DIVERGENCE_BACKENDS

FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def within_float32(value: numbers.Real) -> bool:
    """Whether a real number is finite and within float32's range (an int too large for any float is not)."""
    try:
        return abs(float(value)) <= FLOAT32_MAX
    except OverflowError:  # an int beyond any float (10**400)
        return False


def _finite(value: numbers.Real) -> bool:
    """Whether a real number is finite as a float (an int too large for any float is not)."""
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond any float (10**400)
        return False


def _has_type(value: Any, kind: Any) -> bool:
    """Whether ``value`` fits a field's declared type (``float``, ``int | None``, ``list[float] | None``, ...); a bool
    is not a number, an int is a float; a type this check does not read is left to the field's own validation."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        return any(_has_type(value, option) for option in typing.get_args(kind))
    if kind is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(kind) or (Any,)
        return isinstance(value, (list, tuple)) and all(_has_type(element, item) for element in value)
    if kind is bool:
        return isinstance(value, bool)
    if kind in (float, int):
        return isinstance(value, numbers.Real if kind is float else numbers.Integral) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    return True


def check_field_types(config: Any, names: Sequence[str]) -> None:
    """Refuse a field whose value does not have its declared type (a scalar where a list is expected, text where a
    number is, None where the field takes none), naming the field: a YAML recipe or a Python call hands values over
    unconverted, and a wrong type would otherwise fail deep inside a step, or silently (text iterated as a list)."""
    hints = typing.get_type_hints(type(config))  # the declared types (argument parsers rewrite the fields' own)
    for name in names:
        value = getattr(config, name)
        if not _has_type(value, hints[name]):
            kind = hints[name].__name__ if isinstance(hints[name], type) else str(hints[name]).replace("typing.", "")
            raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r:.60}.")


def check_config_ranges(config: Any) -> None:
    """Each MRTPO setting in its range, and TRL's settings that credit assignment replaces at their defaults (after
    GRPOConfig's own ``__post_init__``, which normalises them)."""
    iterations = config.max_tool_calling_iterations
    # TRL compares it with a counter: -1 runs no tool at all and 2.5 runs three rounds, without a word
    if iterations is not None and (isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 0):
        raise ValueError(
            f"max_tool_calling_iterations must be None (no limit) or an integer >= 0, got {iterations!r}."
        )
    if not isinstance(config.credit_assignment, str) or not config.credit_assignment:
        raise ValueError(f"credit_assignment must name a rule, got {config.credit_assignment!r}.")
    if not 0.0 <= config.credit_beta <= 1.0:
        raise ValueError(f"credit_beta must be in [0, 1], got {config.credit_beta}.")
    if config.credit_warmup_steps < 0:
        raise ValueError(f"credit_warmup_steps must be >= 0, got {config.credit_warmup_steps}.")
    if config.credit_warmup_steps >= 1 and config.credit_warmup_steps != int(config.credit_warmup_steps):
        raise ValueError(
            f"credit_warmup_steps must be a whole number of steps, or a share of max_steps below 1, got "
            f"{config.credit_warmup_steps}."
        )
    if config.max_second_moment_ratio < 1.0:
        raise ValueError(
            "max_second_moment_ratio must be >= 1 (1 forbids any redistribution), "
            f"got {config.max_second_moment_ratio}."
        )
    if config.credit_assignment != "grpo":
        # MRTPO's pipeline normalises each reward per group itself (method step 1) and rescales by the
        # token-weighted batch std (step 8): TRL's own aggregation and scaling never run.
        for name, default in (("scale_rewards", "group"), ("multi_objective_aggregation", "sum_then_normalize")):
            if getattr(config, name) != default:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} only applies to credit_assignment='grpo' (plain "
                    f"GRPOTrainer). In {config.credit_assignment!r} mode every reward is normalised per group and "
                    f"the token advantages are rescaled by the batch std; leave {name} at {default!r}, or use "
                    "credit_assignment='grpo' for TRL's own behaviour."
                )
    floor = config.reward_strength_floor
    if floor is not None and not 0.0 < floor <= 0.5:
        raise ValueError(f"reward_strength_floor must be in (0, 0.5] or None, got {floor}.")
    if config.replay_batch_size < 1:
        raise ValueError(f"replay_batch_size must be >= 1, got {config.replay_batch_size}.")
    if config.collapse_warning_steps < 0:
        raise ValueError(f"collapse_warning_steps must be >= 0, got {config.collapse_warning_steps}.")
    if config.divergence_backend not in DIVERGENCE_BACKENDS:
        raise ValueError(
            f"divergence_backend must be one of {', '.join(DIVERGENCE_BACKENDS)}, got {config.divergence_backend!r}."
        )
    if config.replay_chunk_size is not None and config.replay_chunk_size < 1:
        raise ValueError(f"replay_chunk_size must be >= 1 or None, got {config.replay_chunk_size}.")


def check_finite_fields(config: Any, names: Sequence[str]) -> None:
    """Refuse a non-finite value (NaN or infinity) in any of the named numeric fields, or in a list of weights
    (``reward_weights``, ``process_reward_weights``)."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, numbers.Real) and not isinstance(value, bool) and not _finite(value):
            raise ValueError(f"{name} must be a finite number, got {value!r:.40}.")
    for name in ("reward_weights", "process_reward_weights"):
        for i, weight in enumerate(getattr(config, name, None) or ()):
            if not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not _finite(weight):
                raise ValueError(f"{name}[{i}] must be a finite number, got {weight!r:.40}.")
            if not within_float32(weight):
                raise ValueError(f"{name}[{i}]={weight!r:.40} is beyond float32's range.")
