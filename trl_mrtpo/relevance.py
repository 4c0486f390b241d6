"""The relevance provider (docs/method.md, steps 2-4): the only part of MRTPO that runs the policy for credit. It
turns a batch and its info blocks into q ``[B, K, C]`` and the replayed pairs ``[B, K]``: the contexts
(:func:`~trl_mrtpo.info_blocks.replay_contexts`, tokenised as TRL tokenises prompts), the prefix-tree replay and the
divergence op (:mod:`trl_mrtpo.replay`).

A provider is any callable ``provider(trainer, batch, removal) -> Relevance``; the trainer calls it every generation
batch on every process, with or without work (replays run collectives under sharding). Pass another one as
``MRTPOTrainer(..., relevance_provider=...)``: a reference model's replay, or known relevant tokens (the credit gym's
oracle).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from ._trl import tokenize_prompts, whole_policy
from .constants import MIN_SHARED_PREFIX, REPLAY_BATCH_SIZE
from .info_blocks import check_context_length, replay_contexts
from .replay import placed_relevance, replay_relevance
from .strength import generation_batch_index
from .utils import completion_text


class Relevance(NamedTuple):
    relevance: torch.Tensor  # [B, K, C] q, zero where nothing was replayed
    replayed: torch.Tensor  # [B, K] bool
    any_replayed: bool  # known without a device sync


class RelevanceProvider(Protocol):
    def __call__(self, trainer: Any, batch: Any, removal: str) -> Relevance: ...


def replay_inputs(trainer: Any, batch: Any, joint: bool) -> tuple[list[list[int]], list, list[list[int]]]:
    """Step 2 on the local batch, tokenised as TRL tokenises prompts. Returns ``(wanted, context_ids,
    completion_ids)``: per response, the replayed rewards, the contexts' token ids ``[P_all, P_removed...]`` (empty
    when nothing is replayed) and the completion's token ids."""
    args, strength = trainer.args, trainer.reward_strength
    batch_index = generation_batch_index(
        trainer.state.global_step, args.gradient_accumulation_steps, args.steps_per_generation, trainer.num_iterations
    )
    wanted, blocks, contexts = replay_contexts(
        trainer.info_block_builders,
        trainer.reward_func_names,
        batch.prompts,
        [completion_text(c) for c in batch.completions],
        batch.inputs,
        batch.rewards,
        batch.varying,
        batch.views,
        batch.mask.any(-1).tolist(),
        joint=joint,
        only_varying=args.replay_only_varying,
        resting=strength.resting(trainer.state.global_step, args.credit_warmup_steps, batch_index),
        separator=args.info_block_separator,
        header=trainer._assistant_header,
        special_tokens=trainer._special_tokens,
    )
    flat = [context for sample in contexts for context in sample]
    owners = [i for i, sample in enumerate(contexts) for _ in sample]
    flat_ids = iter(tokenize_prompts(trainer, flat, owners) if flat else [])
    context_ids = [[next(flat_ids) for _ in sample] for sample in contexts]
    completion_ids = batch.completion_ids
    prompt_lengths = batch.output["prompt_mask"].sum(-1).tolist()
    limit = getattr(trainer.accelerator.unwrap_model(trainer.model).config, "max_position_embeddings", None)
    check_context_length(context_ids, completion_ids, blocks, prompt_lengths, trainer.reward_func_names, limit)
    return wanted, context_ids, completion_ids


class ReplayRelevance:
    """q from the policy itself: the batch's contexts (read through ``trainer._replay_inputs``, which subclasses may
    instrument), replayed as a prefix tree with ``batch_size`` sequences per forward, sharing a prefix once it has
    ``min_shared_prefix`` new tokens (None: never)."""

    def __init__(self, batch_size: int = REPLAY_BATCH_SIZE, min_shared_prefix: int | None = MIN_SHARED_PREFIX):
        self.batch_size = batch_size
        self.min_shared_prefix = min_shared_prefix

    def __call__(self, trainer: Any, batch: Any, removal: str) -> Relevance:
        joint = removal == "all"
        wanted, context_ids, completion_ids = trainer._replay_inputs(batch, joint)
        args = trainer.args
        # every process enters (collectives under sharding and in the reading), even one with nothing to replay
        with whole_policy(trainer) as policy:
            q = []
            if any(wanted):
                q = replay_relevance(
                    policy,
                    context_ids,
                    completion_ids,
                    trainer._replay_temperature,
                    backend=args.divergence_backend,
                    chunk_size=args.replay_chunk_size,
                    batch_size=self.batch_size,
                    min_shared_prefix=self.min_shared_prefix,
                )
        relevance, replayed = placed_relevance(q, wanted, batch.mask, batch.varying.shape[1], joint)
        return Relevance(relevance, replayed, any(wanted))
