"""What one generation batch carries between MRTPO's steps: the rewards TRL scored, and this process's slice with its
response-level advantages."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .trajectories import Trajectory


@dataclass
class Scored:
    """What TRL scored for one generation batch (rewards gathered over processes), until MRTPO uses it."""

    inputs: list[dict]
    prompts: list
    completions: list
    completion_ids: list[list[int]]  # unpadded, as generated (also where TRL later zeroes a truncated one's mask)
    rewards: torch.Tensor


@dataclass
class ScoredBatch:
    """This process's slice of a scored batch, with its response-level advantages and TRL's generation output."""

    inputs: list[dict]
    prompts: list
    completions: list
    completion_ids: list[list[int]]  # unpadded, as generated
    rewards: torch.Tensor  # [B, K]
    group_advantages: torch.Tensor  # [B, K], after any response-level weighting
    varying: torch.Tensor  # [B, K] bool: the reward varies within the response's group
    reward_weights: torch.Tensor  # [K] or [B, K]
    mask: torch.Tensor  # [B, C] completion (and tool) mask
    output: dict
    groups: torch.Tensor | None = None  # [B, K] information groups, once step 2 has built the blocks
    info_blocks: list | None = None  # per response, each reward's InfoBlock or None, once step 2 built them (heatmap)
    reduction: ProcessSum | None = None  # the batch's one sum over the processes (None on one process)

    @property
    def information_groups(self) -> torch.Tensor:
        """``[B, K]`` each reward's information group: the first reward whose block carries the same text
        (:func:`~trl_mrtpo.info_blocks.information_groups`); each reward its own before step 2 or without blocks."""
        if self.groups is not None:
            return self.groups
        return torch.arange(self.varying.shape[1], device=self.varying.device).expand(self.varying.shape)

    @classmethod
    def local(
        cls,
        scored: Scored,
        rows: slice,
        group_advantages: torch.Tensor,
        varying: torch.Tensor,
        reward_weights: torch.Tensor,
        output: dict,
    ) -> ScoredBatch:
        """This process's ``rows`` of a scored batch, with the gathered batch's ``[N, K]`` group advantages and
        ``varying``, and TRL's generation output (its credit mask)."""
        return cls(
            inputs=scored.inputs,
            prompts=scored.prompts,
            completions=scored.completions,
            completion_ids=scored.completion_ids,
            rewards=scored.rewards[rows],
            group_advantages=group_advantages[rows],
            varying=varying[rows],
            reward_weights=reward_weights,
            mask=credit_mask(output),
            output=output,
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, K, C)``: responses, rewards, completion positions (the shape of q and the token weights)."""
        return (*self.varying.shape, self.mask.shape[1])

    @cached_property
    def views(self) -> list[Trajectory | None]:
        """Each response's tool-rollout view (:func:`~trl_mrtpo.trajectories.tool_views`), read once per batch by the
        info blocks and the failure boundaries; Nones without tool rollouts (the views' module is not loaded then)."""
        if "tool_mask" not in self.output:
            return [None] * len(self.completions)
        from .trajectories import tool_views

        return tool_views(self.output, self.completions)


def local_slice(scored: Scored, process_index: int) -> slice:
    """This process's rows of a batch gathered over processes (TRL gathers rewards in process order)."""
    size = len(scored.prompts)
    return slice(process_index * size, (process_index + 1) * size)


def credit_mask(output: dict) -> torch.Tensor:
    """``[B, C]`` where credit may land: the completion mask, times TRL's tool mask in tool rollouts (tool results are
    context, not the model's decisions)."""
    mask = output["completion_mask"]
    return mask * output["tool_mask"] if "tool_mask" in output else mask


class ProcessSum:
    """One generation batch's sum over the data-parallel processes, created by the trainer and passed to every step
    that sums (7 and 8, the strength reading): a ``ReduceSum``. A ``rider`` (the guard's flags) travels in each sum,
    concatenated onto the summed tensor, so that it needs no collective of its own; :meth:`alone` sums a tensor
    without it."""

    def __init__(self, reduce: Callable[[torch.Tensor], torch.Tensor]):
        self.alone, self.rider = reduce, None

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.rider is None:
            return self.alone(tensor)
        sent = self.rider.outgoing(tensor.device)
        summed = self.alone(torch.cat([tensor.flatten(), sent.to(tensor.dtype)]))
        self.rider.received(summed[tensor.numel() :])
        return summed[: tensor.numel()].view_as(tensor)
