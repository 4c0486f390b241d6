"""The one guard layer: the credit rule, the credit terms and the relevance provider a run is built from are wrapped
once, at construction, in adapters that check what each returns where it enters (containers, shapes, dtypes and
devices, without a device sync: an error names the part, what it returned and what was expected) and note NaN,
infinity and negative q in the generation batch's :class:`~trl_mrtpo.finite_credit.CreditGuard`, whose flags ride
in the sums of steps 7-8 so that every process raises alike. The trainer calls the adapters as it would the parts:
its per-batch code reads as the steps of docs/method.md."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch

from ..constants import NEGATIVE_Q_TOLERANCE
from ..credit import TokenCredit, weighted_token_advantages
from ..rules import Contribution, CreditInputs, CreditRule, CreditTerm
from ..utils import function_name
from .finite_credit import CreditGuard, part_keys


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


def _checked_credit(part: str, result: Any, batch: Any, call: str) -> TokenCredit:
    """A rule's ``advantages()`` or a term's ``finish()``: a :class:`TokenCredit` with ``[B, C]`` advantages."""
    if not isinstance(result, TokenCredit):
        raise TypeError(f"{part}: {call} returned {_kind(result)}; it returns a TokenCredit.")
    check_tensor(part, "advantages", result.advantages, tuple(batch.mask.shape), "float", batch.mask.device)
    return result


def _read(replayed: torch.Tensor, batch: Any) -> torch.Tensor:
    """``[B, K, C]`` where q is read: the replayed pairs' tokens on the credit mask."""
    return replayed[..., None] & batch.mask[:, None, :].bool()


class BatchGuard:
    """The current generation batch's :class:`CreditGuard`, shared by the adapters (set by :meth:`start`)."""

    def __init__(self, named: tuple[str, str, list[str]], reward_names: list[str]):
        self.parts, self.named, self.reward_names = part_keys(*named[1:]), named, reward_names
        self.current: CreditGuard | None = None

    def start(self, rank: int, num_processes: int, reduce_sum: Callable | None) -> CreditGuard:
        self.current = CreditGuard(self.parts, self.named, self.reward_names, rank, num_processes, reduce_sum)
        return self.current

    def weighting(self, part: str, advantages: torch.Tensor, reward_weights: torch.Tensor) -> None:
        """The local ``[B, K]`` per-reward advantages and the ``[K]`` reward weights are finite."""
        values = advantages * reward_weights.to(advantages)  # NaN or inf in either gives NaN or inf here
        self.current.note(part, ~torch.isfinite(values), per_reward=True)

    def final(self, credit: TokenCredit, mask: torch.Tensor) -> None:
        """The token advantages the loss will see are finite; every process raises alike if any part was not."""
        self.current.note_non_finite("final", credit.advantages, mask, per_reward=False)
        self.current.raise_if_bad()  # the flags rode in steps 7-8's sums


class _Guarded:
    kind = ""  # how errors call it: "the term", "the credit rule"

    def __init__(self, part: CreditRule | CreditTerm, name: str, guard: BatchGuard):
        self.part, self.name, self.guard = part, name, guard
        self.label = f"{self.kind} '{name}'"

    def relevance(self, relevance: torch.Tensor, replayed: torch.Tensor, batch: Any) -> torch.Tensor:
        adjusted = self.part.relevance(relevance, replayed, batch)
        check_tensor(self.label, "relevance()", adjusted, batch.shape, "float", batch.mask.device)
        read = _read(replayed, batch)
        self.guard.current.note_non_finite(f"q:{self.label}", adjusted, read, per_reward=True)
        self.guard.current.note(f"q_negative:{self.label}", (adjusted < -NEGATIVE_Q_TOLERANCE) & read, per_reward=True)
        return adjusted


class GuardedTerm(_Guarded):
    """A credit term whose outputs are checked where they enter (its name in every error)."""

    kind = "the term"

    def weigh(self, rewards, advantages, reward_weights, num_generations, training, local: slice) -> tuple:
        result = self.part.weigh(rewards, advantages, reward_weights, num_generations, training)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                f"{self.label}: weigh() returned {_kind(result)}; it returns (advantages [N, K], reward_weights [K])."
            )
        check_tensor(self.label, "weighed advantages", result[0], tuple(advantages.shape), "float", advantages.device)
        weights_shape = tuple(reward_weights.shape)
        check_tensor(self.label, "reward weights", result[1], weights_shape, "float", reward_weights.device)
        self.guard.weighting(f"weighting:{self.name}", result[0][local], result[1])
        return result

    def __call__(self, batch: Any, tokenizer: Any, num_generations: int, rank: int, state: Any) -> Contribution:
        added = self.part(batch, tokenizer, num_generations, rank, state)
        if not isinstance(added, Contribution):
            raise TypeError(f"{self.label} returned {_kind(added)}; it returns a Contribution (trl_mrtpo.rules).")
        B, K, C = batch.shape
        device = batch.mask.device
        if added.process is not None:
            check_tensor(self.label, "process", added.process, (B, C), "float", device)
            self.guard.current.note_non_finite(f"added:{self.name}", added.process, batch.mask, False)
        if added.failure_suffix is not None:
            check_tensor(self.label, "failure_suffix", added.failure_suffix, (B, K, C), "bool", device)
        return added

    def finish(self, credit: TokenCredit, inputs: CreditInputs) -> TokenCredit:
        finished = _checked_credit(self.label, self.part.finish(credit, inputs), inputs.batch, "finish()")
        mask = inputs.batch.mask
        self.guard.current.note_non_finite(f"finish:{self.name}", finished.advantages, mask, per_reward=False)
        return finished


class GuardedRule(_Guarded):
    """The credit rule, its step-5 weights checked where they enter steps 6-8 and its advantages where they return."""

    kind = "the credit rule"

    def advantages(self, inputs: CreditInputs) -> TokenCredit:
        combine, batch = inputs.combine or weighted_token_advantages, inputs.batch

        def checked_combine(advantages, weights, *args, **kwargs):
            check_tensor(self.label, "token weights", weights, batch.shape, "float", batch.mask.device)
            self.guard.current.note_non_finite("rule", weights, batch.mask[:, None, :], per_reward=True)
            return combine(advantages, weights, *args, **kwargs)

        credit = self.part.advantages(replace(inputs, combine=checked_combine))
        return _checked_credit(self.label, credit, batch, "advantages()")


class GuardedProvider:
    """The relevance provider: its ``Relevance`` checked, its q noted where read, then q off the replayed pairs'
    tokens (padding, tool results) set to 0 and rounding below 0 read as 0."""

    def __init__(self, provider: Callable, label: str, guard: BatchGuard):
        self.provider, self.label, self.guard = provider, label, guard

    def __call__(self, policy: Any, record: Any, batch: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        result = self.provider(policy, record)
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(
                f"{self.label} returned {_kind(result)}; it returns a Relevance(relevance, replayed, any_replayed)."
            )
        relevance, replayed, any_replayed = result
        check_tensor(self.label, "relevance", relevance, batch.shape, "float", batch.mask.device)
        check_tensor(self.label, "replayed", replayed, batch.shape[:2], "bool", batch.mask.device)
        if not isinstance(any_replayed, bool):
            raise TypeError(f"{self.label}: any_replayed is {_kind(any_replayed)}, expected bool.")
        read = _read(replayed, batch)
        self.guard.current.note_non_finite("q", relevance, read, per_reward=True)
        self.guard.current.note("q_negative", (relevance < -NEGATIVE_Q_TOLERANCE) & read, per_reward=True)
        return relevance.masked_fill(~read, 0.0).clamp(min=0.0), replayed, any_replayed  # [-1e-6, 0) is rounding


def guarded(
    rule: CreditRule, rule_name: str, terms: dict[str, CreditTerm], provider: Callable, reward_names: Sequence[str]
) -> tuple[BatchGuard, GuardedRule, list[GuardedTerm], GuardedProvider]:
    """A run's rule, terms (by name) and relevance provider wrapped once, sharing one :class:`BatchGuard`. The
    provider is named "the replay" when it is the built-in one, in the errors and the finiteness hints."""
    from ..relevance import ReplayRelevance

    label = (
        "the replay"
        if isinstance(provider, ReplayRelevance)
        else f"the relevance provider {function_name(provider)!r}"
    )
    guard = BatchGuard((label, rule_name, list(terms)), list(reward_names))
    checked_terms = [GuardedTerm(term, name, guard) for name, term in terms.items()]
    return guard, GuardedRule(rule, rule_name, guard), checked_terms, GuardedProvider(provider, label, guard)
