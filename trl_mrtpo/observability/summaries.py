"""The completions table's credit column (``log_completions``): one readable line per response, where its credit went.
Loaded only by the runs that log that table."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """One display string per token (each id decoded alone); a character whose UTF-8 bytes several tokens share (日
    in byte-level vocabularies) is shown whole on its last token, the others empty, not as U+FFFD pieces."""
    strings, pending = [], []
    for token in ids:
        pending.append(int(token))
        text = tokenizer.decode(pending)
        if text.endswith("\ufffd") and len(pending) < 4:  # a character's bytes so far (at most 4 in UTF-8)
            strings.append("")
            continue
        strings.append(text)
        pending = []
    return strings


def credit_summary(
    tokens: Sequence[str],
    advantages: Sequence[float],
    relevance: Sequence[Sequence[float]],
    names: Sequence[str],
    contributions: dict[str, Sequence[float]] | None = None,
) -> str:
    """One line per response for the completions table: the tokens with the largest token advantages, where each
    replayed reward's q peaks (``relevance`` holds one profile per name; empty profiles are skipped), and where each
    term's contribution (a process reward's, by name) puts its largest blame."""
    order = sorted(range(len(tokens)), key=lambda t: -abs(advantages[t]))[:3]
    parts = ["top |A_t|: " + ", ".join(f"{tokens[t]!r} {advantages[t]:+.2f}" for t in order)]
    for name, q in zip(names, relevance):
        if len(q) and max(q) > 0:
            peak = max(range(len(q)), key=lambda t: q[t])
            parts.append(f"{name} q peaks at {tokens[peak]!r} ({q[peak]:.3f})")
    for name, part in (contributions or {}).items():
        if len(part) and min(part) < 0:
            blame = min(range(len(part)), key=lambda t: part[t])
            parts.append(f"{name} blames {tokens[blame]!r} ({part[blame]:+.2f})")
    return " | ".join(parts)


def credit_summaries(
    tokenizer, completion_ids, mask, advantages, relevance, with_q, names: Sequence[str], contributions=None
) -> list[str]:
    """:func:`credit_summary` of each response of a batch, over its model tokens (where ``mask`` ``[B, C]`` is 1):
    ``completion_ids`` and ``advantages`` ``[B, C]``, ``relevance`` ``[B, K, C]`` and ``with_q`` ``[B, K]`` (the
    pairs whose q profile is shown), ``contributions`` the terms' parts by name (``[B, C]`` each). A fixed number of
    host syncs for the whole batch, not one per response."""
    positions = [[t for t, real in enumerate(row) if real] for row in mask.bool().tolist()]
    contributions = contributions or {}
    ids, advantages, relevance, with_q = (  # the terms' parts ride with the advantages: one transfer
        completion_ids.tolist(),
        torch.stack([advantages, *(part.to(advantages) for part in contributions.values())], 1).tolist(),
        relevance.tolist(),
        with_q.tolist(),
    )
    summaries = []
    for j, where in enumerate(positions):
        tokens = token_strings(tokenizer, [ids[j][t] for t in where])
        profiles = [[relevance[j][k][t] for t in where] if with_q[j][k] else [] for k in range(len(names))]
        final, *parts = ([row[t] for t in where] for row in advantages[j])
        summaries.append(credit_summary(tokens, final, profiles, names, dict(zip(contributions, parts))))
    return summaries
