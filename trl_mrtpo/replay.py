"""No-grad replay of sampled completions under several contexts, returning per-token relevance q (DESIGN.md §1
step 4).

The same completion tokens are teacher-forced after ``P_all`` and after each ``P_not_k`` with the sampling-time
weights, dropout off and the sampling temperature. All sequences of a batch are run together, sorted by length, in
mini-batches; the last hidden states at completion positions then go through :func:`trl_mrtpo.ops.replay_divergence`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from trl.trainer.utils import maybe_gather_lm_head_ctx

from .ops import replay_divergence


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The decoder (returning last hidden states) and the lm_head of a causal LM, PEFT-wrapped or not.

    Under LoRA the adapter layers live inside the decoder, so the replay sees the adapted policy.
    """
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if decoder is None or head is None:
        raise ValueError(
            f"MRTPO replay needs a causal LM with get_decoder() and get_output_embeddings(); "
            f"{type(model).__name__} does not provide them."
        )
    if type(head) is not nn.Linear:
        raise ValueError(
            f"MRTPO replay reads the lm_head weight directly, but the output layer is a {type(head).__name__} "
            "(e.g. LoRA on lm_head). Leave lm_head out of the adapter's target_modules."
        )
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError("MRTPO replay does not support final_logit_softcapping models yet.")
    return decoder, head


@contextmanager
def eval_mode(model: nn.Module):
    """Dropout off for the replay, restoring the previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@torch.no_grad()
def completion_hidden_states(
    model: nn.Module, contexts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], batch_size: int
) -> list[torch.Tensor]:
    """Last hidden states ``[L_i, H]`` predicting each completion token, for each (context_i, completion_i) pair.

    Sequences are sorted by length and right-padded per mini-batch (positions of real tokens are unchanged by
    right padding).
    """
    decoder, _ = causal_lm_parts(model)
    device = next(model.parameters()).device
    order = sorted(range(len(contexts)), key=lambda i: -(len(contexts[i]) + len(completions[i])))
    out: list[torch.Tensor | None] = [None] * len(contexts)
    with eval_mode(model):
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            seqs = [list(contexts[i]) + list(completions[i]) for i in chunk]
            width = max(len(s) for s in seqs)
            input_ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
            attention_mask = torch.zeros_like(input_ids)
            for row, seq in enumerate(seqs):
                input_ids[row, : len(seq)] = torch.tensor(seq, device=device)
                attention_mask[row, : len(seq)] = 1
            hidden = decoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
            for row, i in enumerate(chunk):
                first = len(contexts[i]) - 1  # the state after the last context token predicts completion token 0
                out[i] = hidden[row, first : first + len(completions[i])]
    return out


@torch.no_grad()
def replay_relevance(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    batch_size: int = 8,
    chunk_size: int | None = None,
) -> list[torch.Tensor]:
    """Relevance q for every replayed context of every response.

    Args:
        model: the policy (sampling-time weights).
        contexts: per response j, token ids ``[P_all, P_removed_1, ..., P_removed_m]``; responses with fewer
            than two contexts are skipped.
        completions: per response j, its completion token ids (unpadded).
        temperature: sampling temperature.
        batch_size: sequences per replay forward.
        chunk_size: tokens per divergence chunk (see :func:`replay_divergence`).

    Returns:
        per response j, ``[m_j, L_j]`` fp32 q (``[0, L_j]`` when nothing is replayed).
    """
    if len(contexts) != len(completions):
        raise ValueError(f"{len(contexts)} context lists for {len(completions)} completions")
    flat_contexts, flat_completions, owners = [], [], []
    for j, (ctx, completion) in enumerate(zip(contexts, completions)):
        if len(ctx) > 1 and len(completion) > 0:
            flat_contexts.extend(ctx)
            flat_completions.extend([completion] * len(ctx))
            owners.append((j, len(ctx)))
    hidden = completion_hidden_states(model, flat_contexts, flat_completions, batch_size)
    _, head = causal_lm_parts(model)
    results = [torch.zeros(0, len(c)) for c in completions]
    cursor = 0
    # The divergence reads the lm_head weight directly: gather it when ZeRO-3 or FSDP2 shards it.
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        for j, count in owners:
            states = hidden[cursor : cursor + count]
            cursor += count
            results[j] = replay_divergence(states[0], torch.stack(states[1:]), weight, bias, temperature, chunk_size)
    return results
