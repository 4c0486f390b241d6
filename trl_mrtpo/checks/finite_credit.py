"""Every generation batch's credit is checked for NaN and infinity before the optimizer can see it
(docs/behaviour.md, "Non-finite credit").

A non-finite value in q, in a term's added advantages, in a response weighting or in a rule's token weights would give
NaN parameters after one step, or make a pair's credit silently uniform (a NaN q has no mean). :class:`CreditGuard`
counts such values per part and reward as the trainer meets them, without a host sync; the counts ride in the sums of
steps 7 and 8, which every process enters every batch, so every process raises the same :class:`NonFiniteCredit` in
the same batch, naming the part, the reward and the first sample, with one host sync per batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..credit import ReduceSum


class NonFiniteCredit(ValueError):
    """A generation batch's credit holds NaN or infinity (or q below 0); raised before the optimizer step."""


def part_keys(rule: str, terms: Sequence[str]) -> list[str]:
    """The checked parts of a batch's credit, in the order the trainer meets them (the first part flagged is named;
    what follows inherits its NaN); their words are :func:`~trl_mrtpo.checks.credit_messages.credit_parts`'s, loaded
    when a batch is refused."""
    labels = [*(f"the term '{t}'" for t in terms), f"the credit rule '{rule}'"]  # in the order q passes them
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
        reduce_sum: sums a tensor over the processes (None on one process).
    """

    def __init__(
        self,
        parts: Sequence[str],
        named: tuple[str, str, Sequence[str]],
        reward_names: Sequence[str],
        rank: int,
        num_processes: int,
        reduce_sum: ReduceSum | None,
    ):
        self.parts, self.named, self.reward_names = list(parts), named, list(reward_names)
        self.rank, self.num_processes = rank, num_processes
        self._reduce_sum = reduce_sum
        self.sum_over_processes = None if reduce_sum is None else self.reduce_sum  # what steps 7-8 sum with
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

    def reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The trainer's sum over processes, carrying this batch's flags with it (no extra collective)."""
        self._sent = self._flags(tensor.device)
        summed = self._reduce_sum(torch.cat([tensor.flatten(), self._sent.to(tensor.dtype)]))
        self._received = summed[tensor.numel() :].to(self._sent)
        return summed[: tensor.numel()].view_as(tensor)

    def raise_if_bad(self) -> None:
        """Raises :class:`NonFiniteCredit` if any process noted a bad value (one host sync)."""
        if self._counts is None:
            return
        flags = self._flags(self._counts.device)
        if self._reduce_sum is not None and self._received is None:
            # a batch whose credit summed nothing over the processes (a rule that skips steps 7-8) sums the flags now
            flags = self._reduce_sum(flags)
        elif self._reduce_sum is not None:  # what every process sent, and what this one noted since (local only)
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
