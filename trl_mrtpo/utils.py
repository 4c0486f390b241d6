"""Small helpers shared by the trainer and the task kits."""

from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any

from .constants import HUB_ID_FILE


def local_copy(path: str | os.PathLike | None) -> tuple[str, str] | None:
    """``(Hub id, how the copy differs)`` for a local model folder that is a copy of a Hub model (its ``HUB_ID_FILE``:
    the id on the first line, an optional note after it), None for anything else."""
    if path is None or not os.path.isdir(path):
        return None
    marker = os.path.join(path, HUB_ID_FILE)
    if not os.path.isfile(marker):
        return None
    with open(marker, encoding="utf-8") as handle:
        hub_id, _, note = handle.read().strip().partition("\n")
    return (hub_id.strip(), note.strip()) if hub_id.strip() else None


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


def import_path(name: str, kind: str) -> Any:
    """``module.attribute`` imported, the working directory searched for this import only (as TRL's scripts
    resolve a recipe's functions); an error names ``kind`` and ``name``."""
    module_path, attribute = name.rsplit(".", 1)
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        return getattr(importlib.import_module(module_path), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot import {kind} {name!r}: {error}") from error
    finally:
        if added:
            sys.path.remove(os.getcwd())


def public_name(cls: type) -> str:
    """``cls`` by the shortest module path that exports it (``trl_mrtpo.research.ResearchConfig``)."""
    parts = cls.__module__.split(".")
    for end in range(1, len(parts) + 1):
        module = sys.modules.get(".".join(parts[:end]))
        if getattr(module, cls.__name__, None) is cls:
            return f"{module.__name__}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"
