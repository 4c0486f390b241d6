"""Task kits: everything trl-mrtpo knows about one task, in one module per task, and the registry of kits.

A kit module defines ``KIT = Kit(...)``: its reward functions (TRL's signature), one info-block builder per reward,
its built-in training data, the adapters that read published data, and the response spans each verifier checks (for
the localisation report of ``trl-mrtpo inspect``). The demo, ``trl-mrtpo train``, ``inspect``, the registry of names
that recipes use and the benchmarks all read kits through :func:`get_kit`.

Adding a kit: write ``trl_mrtpo/kits/<module>.py`` with its ``KIT`` and add ``"<name>": "<module>"`` to
``KIT_MODULES``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..utils import import_path

# name -> module under trl_mrtpo.kits; modules are imported on first use (the SQL kit needs sqlglot, ...)
KIT_MODULES = {
    "basic": "basic",
    "sql": "sql",
    "if": "instruction_following",
    "tools": "tool_calling",
    "agent": "tool_agent",
    "short": "short_answers",
}
KIT_NAMES = tuple(KIT_MODULES)
# kits whose rollouts are multi-turn through an environment: they need a model and chat template that call tools
# (TRL's response schema), which the demo's and inspect's embedded model has not
SINGLE_TURN_KITS = tuple(name for name in KIT_NAMES if name != "agent")
# what a kit needs beyond the core install, and the extra that brings it
KIT_REQUIREMENTS = {"sql": (("sqlglot",), "sql"), "if": (("if_verifiable", "nltk"), "if")}

Spans = dict[str, tuple[str, list[tuple[int, int]]]]


def cache_root() -> Path:
    """Where trl-mrtpo caches what it builds once (the converted embedded model, downloaded databases):
    ``$TRL_MRTPO_CACHE``, else ``$XDG_CACHE_HOME/trl_mrtpo`` (``~/.cache/trl_mrtpo``)."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_mrtpo"
    return Path(os.environ.get("TRL_MRTPO_CACHE", default))


def require(module: str, needed_for: str, install: str) -> None:
    """A one-line ImportError naming the command to run when an optional package is missing, before anything that
    needs it starts (instead of an ImportError deep inside)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{needed_for} needs the '{module}' package, which is not installed: {install}")


@dataclass(frozen=True)
class Kit:
    """One task: what it rewards, where each reward's information sits, and its data.

    Parameters:
        name (`str`):
            Registry name (``--task`` of the CLI).
        description (`str`):
            One line for ``--help``.
        rewards (`list[Callable]`):
            Reward functions with TRL's signature, in order.
        info_blocks (`list[Callable | None]`):
            One info-block builder (or None: uniform credit) per reward.
        dataset (`Callable[[int, int, str | None], Dataset]`):
            ``dataset(num_prompts, seed, cache_dir)``: the built-in training data (kits with a fixed set of examples
            return all of them, shuffled by ``seed``).
        spans (`Callable[[dict, str], dict]` or `None`):
            ``spans(row, text)``: per reward *name*, ``(span kind, [(start, end), ...])``: the characters of the
            response that reward's verifier checks, for the localisation report.
        report_label (`str` or `None`):
            When set, the localisation report pools every reward under this label (the instruction-following slots
            hold a different constraint per prompt).
        loaders (`dict[str, Callable]`):
            ``data_loader`` name -> ``load(data_path, data_split_file, database_dir)``: a training Dataset read from
            published data.
        failure_boundaries (`list[Callable | None]`):
            One failure-boundary builder (or None) per reward, where the verifier knows where a failing response's
            unrecovered error ends (the trainer's ``failure_boundaries``); empty: none.
        environment (`Callable` or `None`):
            For a multi-turn tool task: the environment class (TRL's ``environment_factory``) whose methods are the
            tools; None for single-turn kits.
        examples (`str` or `None`):
            A ``--completions`` file under ``kits/examples/``: responses to one prompt, each reward's failing one
            differing from the passing one in a few tokens (``trl-mrtpo inspect --completions example``: the pair
            test, docs/inspect.md).
    """

    name: str
    description: str
    rewards: list[Callable]
    info_blocks: list[Callable | None]
    dataset: Callable[..., Any]
    spans: Callable[[dict, str], Spans] | None = None
    report_label: str | None = None
    loaders: dict[str, Callable[..., Any]] = field(default_factory=dict)
    failure_boundaries: list[Callable | None] = field(default_factory=list)
    environment: Callable[[], Any] | None = None
    examples: str | None = None

    @property
    def examples_path(self) -> str | None:
        """The kit's pass/fail examples as a ``--completions`` file (None: it ships none)."""
        return None if self.examples is None else str(Path(__file__).parent / "examples" / self.examples)

    def __post_init__(self):
        if len(self.rewards) != len(self.info_blocks):
            raise ValueError(f"kit {self.name!r}: {len(self.rewards)} rewards but {len(self.info_blocks)} info blocks")
        if self.failure_boundaries and len(self.failure_boundaries) != len(self.rewards):
            raise ValueError(
                f"kit {self.name!r}: {len(self.rewards)} rewards but {len(self.failure_boundaries)} failure boundaries"
            )


def get_kit(name: str) -> Kit:
    """The kit registered under ``name`` (``basic``, ``sql``, ``if``, ``tools``, ``agent`` or ``short``)."""
    if name not in KIT_MODULES:
        raise ValueError(f"unknown task {name!r}; choose one of {', '.join(KIT_NAMES)}")
    modules, extra = KIT_REQUIREMENTS.get(name, ((), ""))
    for module in modules:
        require(module, f"the '{name}' kit", f'pip install "trl-mrtpo[{extra}]"')
    return importlib.import_module(f"{__name__}.{KIT_MODULES[name]}").KIT


def data_loaders() -> dict[str, Callable[..., Any]]:
    """Every kit's data loaders by name (``spider``, ``bird``, ``hir``, ``rlla``)."""
    return {loader: load for name in KIT_NAMES for loader, load in get_kit(name).loaders.items()}


def resolve(name: str, kind: str) -> Callable | None:
    """A reward function (``kind="reward"``) or info-block builder (``kind="info_block"``) by a kit's name for it
    or a dotted import path (``my_pkg.rewards.my_reward``, resolved from the working directory too); anything else
    (a process reward) by dotted path only. ``"none"`` gives None (a reward without an info block).

    A dotted path imports no kit (a core install without the kits' extras resolves it); a plain name imports the
    kits whose extras are installed and, when it is in none of them, says which kits could not be searched."""
    if kind == "info_block" and name.lower() == "none":
        return None
    if "." in name:  # kits' functions have plain names: a dot is an import path
        return _import_path(name, kind)
    registry, unavailable = {}, []
    for kit_name in KIT_NAMES if kind in ("reward", "info_block") else ():
        try:
            kit = get_kit(kit_name)
        except ImportError as error:
            unavailable.append(str(error))
            continue
        functions = kit.rewards if kind == "reward" else kit.info_blocks
        registry.update({f.__name__: f for f in functions if f is not None})
    if name in registry:
        return registry[name]
    unsearched = f" Not searched: {' '.join(unavailable)}" if unavailable else ""
    raise ValueError(
        f"unknown {kind} {name!r}: use a dotted import path or one of {', '.join(sorted(registry))}.{unsearched}"
    )


def _import_path(name: str, kind: str) -> Callable:
    """``module.attribute`` imported (:func:`~trl_mrtpo.utils.import_path`), refused unless callable."""
    value = import_path(name, kind)
    # TRL would call a number ("'float' object has no attribute '__call__'") and load a string as a Hub reward model
    if not callable(value):
        raise ValueError(
            f"{kind} {name!r} is a {type(value).__name__} ({value!r:.60}), not a function: name a callable (a {kind} "
            "function, or a class for a process reward)."
        )
    return value
