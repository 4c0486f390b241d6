"""What a credit rule, a credit term or a relevance provider returns, checked where it enters the trainer, once per
generation batch and without a device sync (containers, shapes, dtypes and devices only): an error names the part,
what it returned and what was expected, instead of an einsum or unpacking error naming nothing."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .credit import TokenCredit


def _kind(value: Any) -> str:
    return f"a tuple of {len(value)}" if isinstance(value, tuple) else f"a {type(value).__name__}"


def check_tensor(part: str, name: str, value: Any, shape: tuple, kind: str, device: torch.device) -> None:
    """``value`` is a ``kind`` ("float" or "bool") tensor of ``shape`` on ``device``, else an error naming ``part``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{part}: {name} is {_kind(value)}, expected a {kind} tensor of shape {shape}.")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{part}: {name} of shape {tuple(value.shape)}, expected {tuple(shape)}.")
    if (kind == "bool") != (value.dtype == torch.bool) or (kind == "float" and not value.is_floating_point()):
        raise TypeError(f"{part}: {name} of dtype {value.dtype}, expected {kind}.")
    if value.device != device:
        raise ValueError(f"{part}: {name} on {value.device}, expected {device} (the batch's).")


def checked_relevance(part: str, result: Any, shape: tuple, device: torch.device) -> tuple:
    """A provider's ``Relevance(relevance [B, K, C] float, replayed [B, K] bool, any_replayed bool)``."""
    if not isinstance(result, tuple) or len(result) != 3:
        raise TypeError(f"{part} returned {_kind(result)}; it returns a Relevance(relevance, replayed, any_replayed).")
    relevance, replayed, any_replayed = result
    check_tensor(part, "relevance", relevance, shape, "float", device)
    check_tensor(part, "replayed", replayed, shape[:2], "bool", device)
    if not isinstance(any_replayed, bool):
        raise TypeError(f"{part}: any_replayed is {_kind(any_replayed)}, expected bool.")
    return relevance, replayed, any_replayed


def checked_contribution(part: str, result: Any, shape: tuple, device: torch.device) -> tuple[dict, list]:
    """A term's ``({"process": [B, C] | None, "failure_suffix": [B, K, C] bool | None}, [(name, value), ...])``."""
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], Mapping)):
        raise TypeError(
            f"{part} returned {_kind(result)}; it returns ({{'process': ..., 'failure_suffix': ...}}, "
            "[(name, value), ...])."
        )
    contribution, logged = result
    if contribution.get("process") is not None:
        check_tensor(part, "process", contribution["process"], (shape[0], shape[2]), "float", device)
    if contribution.get("failure_suffix") is not None:
        check_tensor(part, "failure_suffix", contribution["failure_suffix"], shape, "bool", device)
    return {"process": contribution.get("process"), "failure_suffix": contribution.get("failure_suffix")}, logged


def checked_weighting(part: str, result: Any, advantages: torch.Tensor, reward_weights: torch.Tensor) -> tuple:
    """A term's ``weigh()``: ``(advantages [N, K], reward_weights [K])`` as it was given them."""
    if not isinstance(result, tuple) or len(result) != 2:
        raise TypeError(
            f"{part}: weigh() returned {_kind(result)}; it returns (advantages [N, K], reward_weights [K])."
        )
    check_tensor(part, "weighed advantages", result[0], tuple(advantages.shape), "float", advantages.device)
    check_tensor(part, "reward weights", result[1], tuple(reward_weights.shape), "float", reward_weights.device)
    return result


def checked_credit(part: str, result: Any, batch: Any, call: str) -> TokenCredit:
    """A rule's ``advantages()`` or a term's ``finish()``: a :class:`TokenCredit` with ``[B, C]`` advantages."""
    if not isinstance(result, TokenCredit):
        raise TypeError(f"{part}: {call} returned {_kind(result)}; it returns a TokenCredit.")
    check_tensor(part, "advantages", result.advantages, tuple(batch.mask.shape), "float", batch.mask.device)
    return result
