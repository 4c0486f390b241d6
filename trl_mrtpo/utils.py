"""Small helpers shared by the trainer and the task kits."""

from __future__ import annotations

import os
import re
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .constants import HUB_ID_FILE


def cache_root() -> Path:
    """Where trl-mrtpo caches what it builds once (the converted embedded model, downloaded databases):
    ``$TRL_MRTPO_CACHE``, else ``$XDG_CACHE_HOME/trl_mrtpo`` (``~/.cache/trl_mrtpo``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_mrtpo"
    return Path(os.environ.get("TRL_MRTPO_CACHE", default))


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


def function_name(func: Any) -> str:
    """What a reward (or process reward) is called in logs and errors: its ``__name__``, else its class name (as TRL
    names reward functions)."""
    return getattr(func, "__name__", None) or type(func).__name__


def reward_columns(rows: Sequence[dict]) -> dict[str, list]:
    """The dataset columns TRL hands a reward function as keyword arguments: one list per column, every column but
    the prompt and the completion fields (as ``GRPOTrainer._calculate_rewards`` builds them)."""
    keys = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")] if rows else []
    return {key: [row[key] for row in rows] for key in keys}


def occurrences(text: str, needle: str, ignore_case: bool = True) -> list[tuple[int, int]]:
    """Character spans of every occurrence of ``needle`` in ``text`` (none for an empty needle)."""
    flags = re.IGNORECASE if ignore_case else 0
    return [m.span() for m in re.finditer(re.escape(needle), text, flags)] if needle else []


def default_threads() -> int:
    """torch threads for a CPU run when none is given: the cores this process may use, less those already busy
    (the 1-minute load average, rounded), at least 1. With torch's default of every core, one busy core stalls each
    parallel region on it: a demo step beside one busy single-threaded process took 115-400 s instead of 15-21 s."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        busy = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        busy = 0.0
    return max(1, min(cores, cores - round(busy)))


def require(module: str, needed_for: str, install: str) -> None:
    """A one-line ImportError naming the command to run when an optional package is missing, before anything that
    needs it starts (instead of an ImportError deep inside)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{needed_for} needs the '{module}' package, which is not installed: {install}")


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    """Trailing moving mean of ``values`` over ``window`` entries (fewer at the start)."""
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]
