"""Small helpers shared by the trainer and the task kits."""

from __future__ import annotations

import os
import re
from typing import Any

from .constants import HUB_ID_FILE


def local_copy_hub_id(path: str | os.PathLike | None) -> str | None:
    """The Hub id a local model folder is a copy of (its ``HUB_ID_FILE``), None for anything else."""
    if path is None or not os.path.isdir(path):
        return None
    marker = os.path.join(path, HUB_ID_FILE)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as handle:
        return handle.read().strip() or None


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


def function_name(func: Any) -> str:
    """What a reward (or process reward) is called in logs and errors: its ``__name__``, else its class name (as TRL
    names reward functions)."""
    return getattr(func, "__name__", None) or type(func).__name__
