"""Small helpers shared by the trainer and the task kits."""

from __future__ import annotations

import re
from typing import Any


def completion_text(completion: Any) -> str:
    """The text of a completion as TRL passes it: a string, or a list of chat messages (contents joined).

    Anything else (malformed input) gives an empty string rather than an exception.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):
        return "".join(m["content"] for m in completion if isinstance(m, dict) and isinstance(m.get("content"), str))
    return ""


def occurrences(text: str, needle: str, ignore_case: bool = True) -> list[tuple[int, int]]:
    """Character spans of every occurrence of ``needle`` in ``text`` (none for an empty needle)."""
    flags = re.IGNORECASE if ignore_case else 0
    return [m.span() for m in re.finditer(re.escape(needle), text, flags)] if needle else []
