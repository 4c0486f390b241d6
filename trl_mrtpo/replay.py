"""No-grad replay of sampled completions under several contexts, returning per-token relevance q (docs/method.md
step 4).

The same completion tokens are teacher-forced after ``P_all`` and after each ``P_not_k`` with the sampling-time
weights, dropout off and the sampling temperature. All sequences of a batch are run together, sorted by length, in
mini-batches, with a shared prompt prefix run once and reused as a key/value cache; the last hidden states at
completion positions then go through :func:`trl_mrtpo.ops.replay_divergence`.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from trl.trainer.utils import maybe_gather_lm_head_ctx

from .constants import MIN_SHARED_PREFIX
from .ops import replay_divergence, sampled_logprobs


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


@torch.no_grad()
def logit_multiplier(model: nn.Module) -> float:
    """The factor ``m`` with ``model(x).logits == m * lm_head(decoder(x))``, measured on a two-token input.

    The replay applies the lm_head itself, so a model that scales its logits inside ``forward`` (Granite's
    ``logits_scaling``, Cohere's ``logit_scale``, ...) is replayed at temperature ``T / m`` to see the distribution
    it samples from. A non-linear transform (soft-capping) has no such factor and is refused with a clear error.
    """
    decoder, _ = causal_lm_parts(model)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[1, 2]], device=device)
    with eval_mode(model), lm_head_parameters(model) as (weight, bias):
        logits = model(input_ids=input_ids, use_cache=False).logits.double()
        hidden = decoder(input_ids=input_ids).last_hidden_state.double()
        raw = hidden @ weight.double().T + (bias.double() if bias is not None else 0.0)
    scale = ((logits * raw).sum() / (raw * raw).sum().clamp(min=1e-30)).item()
    if not torch.allclose(logits, scale * raw, rtol=1e-3, atol=1e-4 * logits.abs().max().item() + 1e-12):
        raise ValueError(
            f"MRTPO replay computes logits from the last hidden state and the lm_head weight, but "
            f"{type(model).__name__} transforms its logits non-linearly inside forward (e.g. soft-capping), so the "
            "replay would not see the sampling distribution. Such models are not supported yet."
        )
    return scale


@contextmanager
def eval_mode(model: nn.Module):
    """Dropout off for the replay, restoring the previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def shared_prefix_length(contexts: Sequence[Sequence[int]]) -> int:
    """Length of the token prefix every context shares, leaving at least the last token of each to the suffix.

    The last context token's state predicts completion token 0, so it must be computed with the completion.
    """
    limit = min(len(c) for c in contexts) - 1
    length = 0
    while length < limit and all(c[length] == contexts[0][length] for c in contexts[1:]):
        length += 1
    return max(length, 0)


def _padded(seqs: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and mask (positions of real tokens are unchanged by right padding)."""
    width = max(len(s) for s in seqs)
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(seqs):
        input_ids[row, : len(seq)] = torch.tensor(seq, device=device)
        attention_mask[row, : len(seq)] = 1
    return input_ids, attention_mask


@torch.no_grad()
def completion_hidden_states(
    model: nn.Module,
    contexts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    batch_size: int,
    groups: Sequence[tuple[int, Sequence[int]]] | None = None,
) -> list[torch.Tensor]:
    """Last hidden states ``[L_i, H]`` predicting each completion token, for each (context_i, completion_i) pair.

    Args:
        model: the causal LM.
        contexts, completions: token ids per sequence.
        batch_size: sequences per forward.
        groups: ``(prefix_length, indices)``: the listed sequences share their first ``prefix_length`` context
            tokens, which are run once and reused as a key/value cache by all of them (prefix length 0: no reuse).
            Default: one group of every sequence, no reuse.

    Within a group, sequences are sorted by length and right-padded per mini-batch.
    """
    decoder, _ = causal_lm_parts(model)
    device = next(model.parameters()).device
    if groups is None:
        groups = [(0, range(len(contexts)))]
    # transformers >= 5.2x renamed `past_key_values` to `cache`
    cache_arg = "cache" if "cache" in inspect.signature(decoder.forward).parameters else "past_key_values"
    out: list[torch.Tensor | None] = [None] * len(contexts)
    with eval_mode(model):
        for prefix_length, indices in groups:
            prefix_cache = None
            if len(indices) < 2:  # a prefix used once is not worth a separate forward
                prefix_length = 0
            if prefix_length > 0:
                prefix = torch.tensor([contexts[indices[0]][:prefix_length]], device=device)
                prefix_out = decoder(input_ids=prefix, use_cache=True)
                prefix_cache = prefix_out[cache_arg] if cache_arg in prefix_out else prefix_out.past_key_values
            order = sorted(indices, key=lambda i: -(len(contexts[i]) + len(completions[i])))
            for start in range(0, len(order), batch_size):
                chunk = order[start : start + batch_size]
                input_ids, attention_mask = _padded(
                    [list(contexts[i][prefix_length:]) + list(completions[i]) for i in chunk], device
                )
                kwargs = {}
                if prefix_cache is not None:
                    cache = copy.deepcopy(prefix_cache)
                    cache.batch_repeat_interleave(len(chunk))
                    prefix_mask = attention_mask.new_ones(len(chunk), prefix_length)
                    positions = torch.arange(prefix_length, prefix_length + input_ids.shape[1], device=device)
                    kwargs = {
                        cache_arg: cache,
                        "position_ids": positions.expand(len(chunk), -1),
                        "use_cache": True,
                    }
                    attention_mask = torch.cat([prefix_mask, attention_mask], dim=1)
                hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
                for row, i in enumerate(chunk):
                    # the state after the last context token predicts completion token 0
                    first = len(contexts[i]) - prefix_length - 1
                    out[i] = hidden[row, first : first + len(completions[i])]
    return out


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

    Responses whose contexts share the same prefix of at least ``min_shared_prefix`` tokens (the prompt of a group,
    before the first removed block) run it once and reuse its key/value cache.
    """
    if len(contexts) != len(completions):
        raise ValueError(f"{len(contexts)} context lists for {len(completions)} completions")
    flat_contexts, flat_completions, owners = [], [], []
    prefix_members: dict[tuple[int, ...], list[int]] = {}
    for j, (ctx, completion) in enumerate(zip(contexts, completions)):
        if len(ctx) >= min_contexts and len(completion) > 0:
            members = range(len(flat_contexts), len(flat_contexts) + len(ctx))
            flat_contexts.extend(ctx)
            flat_completions.extend([completion] * len(ctx))
            owners.append((j, len(ctx), members.start))
            # one context: its prompt is shared with the other responses of its group
            length = shared_prefix_length(ctx) if len(ctx) > 1 else len(ctx[0]) - 1
            if min_shared_prefix is None or length < min_shared_prefix:
                length = 0
            prefix_members.setdefault(tuple(ctx[0][:length]), []).extend(members)
    groups = [(len(prefix), members) for prefix, members in prefix_members.items()]
    return completion_hidden_states(model, flat_contexts, flat_completions, batch_size, groups), owners


@contextmanager
def lm_head_parameters(model: nn.Module):
    """``(weight, bias)`` of the lm_head as full tensors, gathered while in the context when ZeRO-3 or FSDP2 shard
    them (the replay reads the weight directly)."""
    _, head = causal_lm_parts(model)
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        yield weight, bias


@torch.no_grad()
def replay_relevance(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    batch_size: int = 8,
    chunk_size: int | None = None,
    min_shared_prefix: int | None = MIN_SHARED_PREFIX,
    backend: str = "auto",
) -> list[torch.Tensor]:
    """Relevance q for every replayed context of every response.

    Lean replay: every sequence of the batch runs in one sorted, batched pass; each response's ``P_all`` is run
    once and shared by its rewards; a shared prompt prefix is run once and reused as a key/value cache; the
    divergence runs once per number of removed contexts over all responses' tokens.

    Args:
        model: the policy (sampling-time weights).
        contexts: per response j, token ids ``[P_all, P_removed_1, ..., P_removed_m]``; responses with fewer
            than two contexts are skipped.
        completions: per response j, its completion token ids (unpadded).
        temperature: sampling temperature.
        batch_size: sequences per replay forward.
        chunk_size: tokens per divergence chunk (see :func:`replay_divergence`).
        min_shared_prefix: shortest shared prefix worth a cached forward; None turns prefix reuse off.
        backend: divergence backend (see :func:`replay_divergence`).

    Returns:
        per response j, ``[m_j, L_j]`` fp32 q (``[0, L_j]`` when nothing is replayed).
    """
    hidden, owners = replayed_hidden_states(
        model, contexts, completions, batch_size, min_shared_prefix, min_contexts=2
    )
    results = [torch.zeros(0, len(c)) for c in completions]
    by_count: dict[int, list[tuple[int, int]]] = {}
    for j, count, first in owners:
        by_count.setdefault(count, []).append((j, first))
    with lm_head_parameters(model) as (weight, bias):
        for count, members in by_count.items():
            # Responses with the same number of contexts are concatenated along tokens: one call for all.
            states = [torch.cat([hidden[first + c] for _, first in members]) for c in range(count)]
            q = replay_divergence(states[0], torch.stack(states[1:]), weight, bias, temperature, chunk_size, backend)
            lengths = [len(completions[j]) for j, _ in members]
            for (j, _), part in zip(members, q.split(lengths, dim=1)):
                results[j] = part
    return results


@torch.no_grad()
def replay_logprobs(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    batch_size: int = 8,
    min_shared_prefix: int | None = MIN_SHARED_PREFIX,
) -> list[torch.Tensor]:
    """Log-probabilities of the sampled completion tokens after each context (CoRT's contrast, TACO's surprisal).

    Args:
        contexts: per response j, a list of context token ids (empty: skipped).
        completions: per response j, its completion token ids.
        (the other arguments as in :func:`replay_relevance`)

    Returns:
        per response j, ``[len(contexts[j]), L_j]`` fp32 log-probabilities (``[0, L_j]`` when skipped).
    """
    hidden, owners = replayed_hidden_states(
        model, contexts, completions, batch_size, min_shared_prefix, min_contexts=1
    )
    results = [torch.zeros(0, len(c)) for c in completions]
    if not owners:
        return results
    # One call over every sequence of the batch (the lm_head weight is read, and upcast, once).
    states = torch.cat(hidden)
    token_ids = torch.tensor(
        [token for j, count, _ in owners for token in list(completions[j]) * count], device=states.device
    )
    with lm_head_parameters(model) as (weight, bias):
        logprobs = sampled_logprobs(states, token_ids, weight, bias, temperature)
    parts = logprobs.split([count * len(completions[j]) for j, count, _ in owners])
    for (j, count, _), part in zip(owners, parts):
        results[j] = part.view(count, -1)
    return results
