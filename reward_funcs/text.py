"""Rewards on the reply's text: a regular-expression format reward and a length reward."""

from __future__ import annotations

import re

from trl_mrtpo.utils import completion_text


def regex_format_reward(completions: list, format_pattern: list[str], **kwargs) -> list[float]:
    """1 when the whole reply (surrounding whitespace ignored) matches the row's ``format_pattern``, a Python
    regular expression. An invalid pattern raises, naming the row: it is a data error, not model output."""
    scores = []
    for i, (completion, pattern) in enumerate(zip(completions, format_pattern)):
        try:
            compiled = re.compile(pattern, re.DOTALL)
        except re.error as error:
            raise ValueError(f"format_pattern of sample {i} is not a valid regular expression: {error}") from error
        scores.append(float(compiled.fullmatch(completion_text(completion).strip()) is not None))
    return scores


def format_block(*, prompt, completion, row, score) -> str:
    """The format rule, appended at replay time: what ``regex_format_reward`` checks, in words."""
    return row.get("format_rule") or f"Your whole reply must match this pattern: {row['format_pattern']}"


def length_reward(completions: list, max_words: list[int] | None = None, **kwargs) -> list[float]:
    """1 for a non-empty reply within ``max_words`` words (a dataset column; 50 when absent), falling linearly to
    0 at twice the budget. No info block: length is about every token."""
    budgets = max_words if max_words is not None else [50] * len(completions)
    scores = []
    for completion, budget in zip(completions, budgets):
        words = len(completion_text(completion).split())
        scores.append(0.0 if words == 0 else max(0.0, min(1.0, 2.0 - words / budget)))
    return scores
