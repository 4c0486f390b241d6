"""The last hidden states of whole replayed sequences, for the parts that score their tokens (the research room's
quantities, INTUITOR's self-certainty); MRTPO's own replay streams its states into the divergence instead
(:func:`trl_mrtpo.replay.replay_relevance`). Not loaded by a default run."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .replay import completion_hidden_states


def replayed_hidden_states(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    batch_size: int,
    min_shared_prefix: int | None,
    min_contexts: int,
) -> tuple[list[torch.Tensor], list[tuple[int, int, int]]]:
    """Hidden states of every (context, completion) sequence of the responses with at least ``min_contexts``
    contexts and a non-empty completion, with ``(response j, number of contexts, index of its first sequence)``.

    Every sequence of the batch goes through one prefix tree (:func:`completion_hidden_states`), so what the
    contexts of a response, and the responses of a group, share is computed once.
    """
    if len(contexts) != len(completions):
        raise ValueError(f"{len(contexts)} context lists for {len(completions)} completions")
    flat_contexts, flat_completions, owners = [], [], []
    for j, (ctx, completion) in enumerate(zip(contexts, completions)):
        if len(ctx) >= min_contexts and len(completion) > 0:
            owners.append((j, len(ctx), len(flat_contexts)))
            flat_contexts.extend(ctx)
            flat_completions.extend([completion] * len(ctx))
    hidden = completion_hidden_states(model, flat_contexts, flat_completions, batch_size, min_shared_prefix)
    return hidden, owners
