"""The relevance provider (docs/method.md, steps 3-4): the only part of MRTPO that runs the policy for credit.

A provider is any callable ``provider(policy, record) -> Relevance``: ``policy`` the unwrapped model, whole on this
process; ``record`` the batch's :class:`ReplayRecord` (step 2's contexts, tokenised as TRL tokenises prompts). The
trainer calls it every generation batch on every process, with or without work (replays run collectives under
sharding). ``MRTPOTrainer(..., relevance_provider=...)`` takes another: a reference model's, or the gym's oracle.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from .constants import MIN_SHARED_PREFIX, REPLAY_BATCH_SIZE
from .replay import placed_relevance, replay_relevance
from .utils import function_name


class Relevance(NamedTuple):
    relevance: torch.Tensor  # [B, K, C] q, zero where nothing was replayed
    replayed: torch.Tensor  # [B, K] bool
    any_replayed: bool  # known without a device sync


@dataclass(frozen=True)
class ReplayRecord:
    """One generation batch's local slice as a provider reads it (step 2's output and what the replay needs)."""

    completions: list[str]  # each response's text
    completion_ids: list[list[int]]  # each response's token ids, without padding
    mask: torch.Tensor  # [B, C] where credit may land (tool results excluded)
    varying: torch.Tensor  # [B, K] bool: the reward varies within the response's group
    wanted: list[list[int]]  # per response, the rewards whose pair is replayed
    groups: list[list[int]]  # per response, each reward's information group (the first reward sharing its block)
    context_ids: list[list[list[int]]]  # per response, [P_all, P_removed...] token ids, one removal per group
    rows: list[dict]  # each response's dataset row
    joint: bool  # one context without every block (removal "all") rather than one per wanted reward
    temperature: float  # the replay's sampling temperature (a model that scales its logits: T / m)
    backend: str  # the divergence op's backend
    chunk_size: int | None  # tokens per chunk of the divergence op (None: its device rule)
    usable_bytes: int | None  # the run's usable memory on CUDA, which sizes the replay (None: off CUDA)
    process_index: int


RelevanceProvider = Callable[[nn.Module, ReplayRecord], Relevance]


class ReplayRelevance:
    """q from the policy itself: the record's contexts replayed as a prefix tree with ``batch_size`` sequences per
    forward, sharing a prefix once it has ``min_shared_prefix`` new tokens (None: never)."""

    def __init__(self, batch_size: int = REPLAY_BATCH_SIZE, min_shared_prefix: int | None = MIN_SHARED_PREFIX):
        self.batch_size = batch_size
        self.min_shared_prefix = min_shared_prefix

    def __call__(self, policy: nn.Module, record: ReplayRecord) -> Relevance:
        q = []
        if any(record.wanted):
            q = replay_relevance(
                policy,
                record.context_ids,
                record.completion_ids,
                record.temperature,
                backend=record.backend,
                chunk_size=record.chunk_size,
                usable_bytes=record.usable_bytes,
                batch_size=self.batch_size,
                min_shared_prefix=self.min_shared_prefix,
            )
        relevance, replayed = placed_relevance(
            q, record.wanted, record.mask, record.varying.shape[1], record.joint, record.groups
        )
        return Relevance(relevance, replayed, any(record.wanted))


def provider_name(provider: RelevanceProvider) -> str:
    """What errors call a relevance provider: "the replay" for the built-in one (and its subclasses)."""
    return (
        "the replay"
        if isinstance(provider, ReplayRelevance)
        else f"the relevance provider {function_name(provider)!r}"
    )
