"""The guard: it looks at what the credit rule, the credit terms and the relevance provider return where it enters
the method, and at the batch's credit, and changes nothing (docs/behaviour.md, "Non-finite credit").

What user code returns is checked for its container, shape, dtype and device, without a device sync: an error names
the part, what it returned and what was expected. NaN and infinity (and q below 0) are counted per part and reward as
the trainer meets them, without a host sync, in the batch's :class:`CreditGuard`; its counts ride as a rider in the
batch's sums over the processes (steps 7 and 8, which every process enters every batch), so every process raises the
same :class:`NonFiniteCredit` in the same batch, naming the part, the reward and the first sample, with one host sync
per batch. No method here returns a value the method reads: the trainer runs the maths, and the guard sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..constants import NEGATIVE_Q_TOLERANCE
from ..credit import TokenCredit
from ..rules import Contribution, rule_label, term_label


class NonFiniteCredit(ValueError):
    """A generation batch's credit holds NaN or infinity (or q below 0); raised before the optimizer step."""


def part_keys(rule: str, terms: Sequence[str]) -> list[str]:
    """The checked parts of a batch's credit, in the order the trainer meets them (the first part flagged is named;
    what follows inherits its NaN); their words are :func:`~trl_mrtpo.checks.credit_messages.credit_parts`'s, loaded
    when a batch is refused."""
    labels = [*map(term_label, terms), rule_label(rule)]  # in the order q passes them
    own = [f"{kind}:{label}" for label in labels for kind in ("q", "q_negative")]
    return ["q", "q_negative", "weighting", *(f"{kind}:{t}" for kind in ("weighting", "added") for t in terms), *own,
            "rule", *(f"finish:{t}" for t in terms), "final"]  # fmt: skip


class CreditGuard:
    """One generation batch's check (see the module's docstring).

    Args:
        parts: the parts' keys (:func:`part_keys`).
        named: the relevance provider's, the rule's and the terms' names, which word the refusal.
        reward_names: the reward functions' names, K of them.
        rank, num_processes: this process and the data-parallel size.
        reduction: the batch's sum over the processes (:class:`~trl_mrtpo.batch.ProcessSum`; None on one process),
            whose every sum carries this guard's flags as a rider (:meth:`outgoing`, :meth:`received`).
    """

    def __init__(
        self,
        parts: Sequence[str],
        named: tuple[str, str, Sequence[str]],
        reward_names: Sequence[str],
        rank: int,
        num_processes: int,
        reduction: Any,
    ):
        self.parts, self.named, self.reward_names = list(parts), named, list(reward_names)
        self.rank, self.num_processes = rank, num_processes
        self._reduction = reduction
        if reduction is not None:
            reduction.rider = self
        self._counts: torch.Tensor | None = None  # [parts, K + 1] samples with a bad value; column K: no reward axis
        self._first: torch.Tensor | None = None  # [processes, parts] 1 + the first bad local sample (0: none)
        self._received: torch.Tensor | None = None  # the flags summed over the processes by the last reduction
        self._sent: torch.Tensor | None = None  # this process's flags when they were last sent

    def _flags(self, device: torch.device) -> torch.Tensor:
        if self._counts is None:
            self._counts = torch.zeros(len(self.parts), len(self.reward_names) + 1, dtype=torch.float64, device=device)
            self._first = torch.zeros(self.num_processes, len(self.parts), dtype=torch.float64, device=device)
        return torch.cat([self._counts.flatten(), self._first.flatten()])

    def note(self, part: str, bad: torch.Tensor, per_reward: bool) -> None:
        """Records one part's bad values: ``bad`` is bool ``[B, K, ...]`` when ``per_reward``, else ``[B, ...]``;
        True where sample b (and reward k) holds one."""
        self._flags(bad.device)
        if bad.shape[0] == 0:
            return
        index = self.parts.index(part)
        if per_reward:
            bad = bad.reshape(*bad.shape[:2], -1).any(-1)
            self._counts[index, :-1] += bad.sum(0).to(self._counts)
            bad = bad.any(-1)
        else:
            bad = bad.reshape(bad.shape[0], -1).any(-1)
            self._counts[index, -1] += bad.sum().to(self._counts)
        positions = torch.arange(1, bad.numel() + 1, device=bad.device, dtype=torch.float64)
        first = torch.where(bad.any(), torch.where(bad, positions, positions.new_tensor(float("inf"))).min(), 0.0)
        known = self._first[self.rank, index]
        self._first[self.rank, index] = torch.where(known > 0, known, first)

    def note_non_finite(self, part: str, values: torch.Tensor, where: torch.Tensor, per_reward: bool) -> None:
        """Records the NaN and infinite entries of ``values`` where ``where`` (broadcastable) is True."""
        self.note(part, ~torch.isfinite(values) & where.bool(), per_reward)

    def outgoing(self, device: torch.device) -> torch.Tensor:
        """The flags a sum over the processes carries: this process's, as noted so far."""
        self._sent = self._flags(device)
        return self._sent

    def received(self, summed: torch.Tensor) -> None:
        """The flags every process sent, summed."""
        self._received = summed.to(self._sent)

    def raise_if_bad(self) -> None:
        """Raises :class:`NonFiniteCredit` if any process noted a bad value (one host sync)."""
        if self._counts is None:
            return
        flags = self._flags(self._counts.device)
        if self._reduction is not None and self._received is None:
            # a batch whose credit summed nothing over the processes (a rule that skips steps 7-8) sums the flags now
            flags = self._reduction.alone(flags)
        elif self._reduction is not None:  # what every process sent, and what this one noted since (local only)
            flags = self._received + flags - self._sent
        values, size, width = flags.tolist(), self._counts.numel(), self._counts.shape[1]
        counts = [values[i : i + width] for i in range(0, size, width)]
        first = [
            values[size + r * len(self.parts) : size + (r + 1) * len(self.parts)] for r in range(self.num_processes)
        ]
        for index, key in enumerate(self.parts):
            per_reward = counts[index]
            if not any(per_reward):
                continue
            from .credit_messages import credit_parts  # the words, loaded when a batch is refused

            part, hint = credit_parts(*self.named)[key]
            rewards = [
                f"reward '{name}' ({int(n)} sample{'s' * (n != 1)})"
                for name, n in zip(self.reward_names, per_reward)
                if n
            ]
            if per_reward[-1]:
                rewards.append(f"{int(per_reward[-1])} sample{'s' * (per_reward[-1] != 1)}")
            process = next((r for r, row in enumerate(first) if row[index] > 0), self.rank)
            located = f"first at sample {int(first[process][index]) - 1}"
            if self.num_processes > 1:
                located += f" of process {process}"
            raise NonFiniteCredit(
                f"MRTPO: {part}, for {', '.join(rewards)}; {located} of this generation batch. Nothing was trained on "
                f"it. {hint}"
            )


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


class BatchGuard:
    """A run's guard: the parts' names, and the current generation batch's :class:`CreditGuard` (:meth:`begin`).

    Args:
        provider: what errors call the relevance provider ("the replay", or the provider by name).
        rule: the credit rule's name (``credit_assignment``).
        terms: the credit terms' names.
        reward_names: the reward functions' names, K of them.
    """

    def __init__(self, provider: str, rule: str, terms: Sequence[str], reward_names: Sequence[str]):
        self.named, self.reward_names = (provider, rule, list(terms)), list(reward_names)
        self.parts, self.rule = part_keys(rule, terms), rule_label(rule)
        self.current: CreditGuard | None = None

    def begin(self, rank: int, num_processes: int, reduction: Any, advantages: torch.Tensor, weights: torch.Tensor):
        """A generation batch begins: its guard rides on ``reduction``, and steps 1-2's local ``[B, K]``
        advantages and ``[K]`` reward weights are noted."""
        self.current = CreditGuard(self.parts, self.named, self.reward_names, rank, num_processes, reduction)
        self._weighting("weighting", advantages, weights)

    def _weighting(self, part: str, advantages: torch.Tensor, reward_weights: torch.Tensor) -> None:
        values = advantages * reward_weights.to(advantages)  # NaN or inf in either gives NaN or inf here
        self.current.note(part, ~torch.isfinite(values), per_reward=True)

    def weighed(self, term: str, result: Any, advantages: torch.Tensor, reward_weights: torch.Tensor, local: slice):
        """A term's ``weigh()``: ``(advantages [N, K], reward_weights [K])`` like those it was given, finite."""
        label = term_label(term)
        if not isinstance(result, tuple) or len(result) != 2:
            raise TypeError(
                f"{label}: weigh() returned {_kind(result)}; it returns (advantages [N, K], reward_weights [K])."
            )
        check_tensor(label, "weighed advantages", result[0], tuple(advantages.shape), "float", advantages.device)
        check_tensor(label, "reward weights", result[1], tuple(reward_weights.shape), "float", reward_weights.device)
        self._weighting(f"weighting:{term}", result[0][local], result[1])

    def contributed(self, term: str, added: Any, batch: Any) -> None:
        """What a term adds: a :class:`Contribution` of ``[B, C]`` float process advantages (finite) and a ``[B, K,
        C]`` bool failure suffix, each or both None."""
        label = term_label(term)
        if not isinstance(added, Contribution):
            raise TypeError(f"{label} returned {_kind(added)}; it returns a Contribution (trl_mrtpo.rules).")
        (B, K, C), device = batch.shape, batch.mask.device
        if added.process is not None:
            check_tensor(label, "process", added.process, (B, C), "float", device)
            self.current.note_non_finite(f"added:{term}", added.process, batch.mask, False)
        if added.failure_suffix is not None:
            check_tensor(label, "failure_suffix", added.failure_suffix, (B, K, C), "bool", device)

    def provided(self, result: Any, batch: Any) -> None:
        """The relevance provider's ``Relevance(relevance [B, K, C] float, replayed [B, K] bool, any_replayed)``;
        its q finite and not below -1e-6 where it is read."""
        label = self.named[0]
        if not isinstance(result, tuple) or len(result) != 3:
            raise TypeError(
                f"{label} returned {_kind(result)}; it returns a Relevance(relevance, replayed, any_replayed)."
            )
        relevance, replayed, any_replayed = result
        check_tensor(label, "relevance", relevance, batch.shape, "float", batch.mask.device)
        check_tensor(label, "replayed", replayed, batch.shape[:2], "bool", batch.mask.device)
        if not isinstance(any_replayed, bool):
            raise TypeError(f"{label}: any_replayed is {_kind(any_replayed)}, expected bool.")
        self._q("", relevance, replayed, batch)

    def adjusted(self, label: str, relevance: Any, replayed: torch.Tensor, batch: Any) -> None:
        """q as a part's ``relevance()`` returned it (``label``: the rule's or a term's), like the provider's."""
        check_tensor(label, "relevance()", relevance, batch.shape, "float", batch.mask.device)
        self._q(f":{label}", relevance, replayed, batch)

    def _q(self, owner: str, relevance: torch.Tensor, replayed: torch.Tensor, batch: Any) -> None:
        read = replayed[..., None] & batch.mask[:, None, :].bool()  # the replayed pairs' tokens on the credit mask
        self.current.note_non_finite(f"q{owner}", relevance, read, per_reward=True)
        self.current.note(f"q_negative{owner}", (relevance < -NEGATIVE_Q_TOLERANCE) & read, per_reward=True)

    def weights(self, weights: Any, batch: Any) -> None:
        """The rule's step-5 ``[B, K, C]`` token weights, finite, before steps 6-8 read them."""
        check_tensor(self.rule, "token weights", weights, batch.shape, "float", batch.mask.device)
        self.current.note_non_finite("rule", weights, batch.mask[:, None, :], per_reward=True)

    def finished(self, term: str, credit: Any, batch: Any) -> None:
        """A term's ``finish()``: a :class:`TokenCredit` of ``[B, C]`` finite advantages."""
        if not isinstance(credit, TokenCredit):
            raise TypeError(f"{term_label(term)}: finish() returned {_kind(credit)}; it returns a TokenCredit.")
        check_tensor(term_label(term), "advantages", credit.advantages, batch.mask.shape, "float", batch.mask.device)
        self.current.note_non_finite(f"finish:{term}", credit.advantages, batch.mask, per_reward=False)

    def final(self, credit: TokenCredit, mask: torch.Tensor) -> None:
        """The token advantages the loss will see are finite; every process raises alike if any part was not."""
        self.current.note_non_finite("final", credit.advantages, mask, per_reward=False)
        self.current.raise_if_bad()  # the flags rode in steps 7-8's sums
