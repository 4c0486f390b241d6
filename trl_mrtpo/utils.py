"""Small helpers shared by the trainer and the task kits."""

from __future__ import annotations

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
