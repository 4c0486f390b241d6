"""MRTPO's own checkpointed state: one file per process beside TRL's (``mrtpo_state_<rank>.pt``), namespaced by part
(``{"version", "release", "run": identity, "parts": {part: entries}}``), written each checkpoint and read back with
``torch.load(weights_only=True)``. One check, :func:`entry_problems`, runs where the state is written and where it is
read, so that what a run writes it can resume from, and a resumed run continues exactly as an uninterrupted one."""

from __future__ import annotations

import io
import os
import re
from importlib.metadata import version
from typing import Any

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)
STATE_VERSION = 7  # of the state files: 7 adds the replay's memory to 6, whose files read it as undecided (None)
STATE_FILE = re.compile(r"mrtpo_state_(\d+)\.pt")
FRESH = "delete it to resume with a fresh MRTPO state"
PLAIN = "keep tensors, numbers, strings, None, and lists or dicts of them"


def _plain(value: Any) -> bool:
    """What the safe loader reads back: tensors, numbers, strings, None, and lists, tuples and dicts of them."""
    if value is None or isinstance(value, torch.Tensor) or type(value) in (bool, int, float, str):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    return isinstance(value, dict) and all(_plain(k) and _plain(v) for k, v in value.items())


def entry_problems(found: dict, parts: dict[str, Any], num_rewards: int) -> tuple[list, list, list]:
    """The one check of a state, at save and at read: against each part's ``state_checks``, the entries ``found``
    (part -> entries) lacks, those it holds undeclared, and ``(part, entry, what it is instead)`` for each that the
    safe loader cannot read back or that fails its part's own check."""
    missing = [(part, e) for part, checks in parts.items() for e in checks if e not in found.get(part, {})]
    unknown = [(part, str(e)) for part, entries in found.items() for e in entries if e not in parts.get(part, {})]
    bad = []
    for part, checks in parts.items():
        for entry, value in found.get(part, {}).items():
            if entry not in checks:
                continue
            unreadable = (
                f"{type(value).__name__}, which the safe loader (torch.load(weights_only=True)) cannot read back"
            )
            problem = checks[entry](value, num_rewards) if _plain(value) else f"{unreadable}: {PLAIN}"
            bad += [] if problem is None else [(part, entry, problem)]
    return missing, unknown, bad


def read_credit_state(path: str, identity: dict, parts: dict[str, Any]) -> dict:
    """Each part's entries from the state file at ``path``, loaded safely and checked against the run resuming from
    it (``parts``: part -> its ``state_checks``): a damaged or foreign file, another version, one written for other
    rewards or credit settings, or an entry missing, unknown or failing its check stops with the file named."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:
        raise ValueError(
            f"{path} cannot be read as MRTPO's checkpoint state ({type(error).__name__}: {error}). It "
            f"is damaged, from another program, or from an older trl-mrtpo release; {FRESH}."
        ) from error
    if not isinstance(state, dict) or "version" not in state:
        found = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not an MRTPO checkpoint state (found: {found}); delete it or resume elsewhere.")
    written = state["version"]
    if isinstance(written, int) and written > STATE_VERSION:
        raise ValueError(
            f"{path} was written by trl-mrtpo {state.get('release', 'of a later release')} (state "
            f"version {written}); this release ({version('trl-mrtpo')}) reads version {STATE_VERSION}: "
            "upgrade trl-mrtpo to resume from it."
        )
    if written not in (6, STATE_VERSION) or not isinstance(state.get("parts"), dict):
        raise ValueError(
            f"{path} has MRTPO state version {written}, this release reads versions 6 and {STATE_VERSION}; {FRESH}."
        )
    run = state.get("run") if isinstance(state.get("run"), dict) else {}
    differences = [
        f"{key}: {run.get(key)!r} in the checkpoint, {value!r} now"
        for key, value in identity.items()
        if run.get(key) != value
    ]
    if differences:  # the real cause: another run's per-reward state, or state of settings this run does not have
        cause = (
            "its per-reward state would be applied to the wrong rewards"
            if run.get("reward_names") != identity.get("reward_names")
            else "its credit state belongs to those settings (a rule's and terms' "
            "state, per-reward strength read under them), which this run does not continue"
        )
        raise ValueError(
            f"{path} was written by a run with another setup ({'; '.join(differences)}): {cause}. Resume "
            "with the same rewards and credit settings, or start a new run (resume_from_checkpoint=None)."
        )
    found = {part: entries if isinstance(entries, dict) else {} for part, entries in state["parts"].items()}
    if written == 6:  # the parts version 7 added start afresh
        found = {**{part: dict.fromkeys(checks) for part, checks in parts.items()}, **found}
    missing, unknown, bad = entry_problems(found, parts, len(identity["reward_names"]))
    if missing or unknown:
        lacks = f"lacks the entry {', '.join(e for _, e in missing)} " if missing else ""
        holds = f"holds the entry {', '.join(sorted(e for _, e in unknown))} " if unknown else ""
        raise ValueError(
            f"{path}: MRTPO's state {lacks}{'and ' if lacks and holds else ''}{holds}that this run's "
            "rule and terms declare otherwise (their state changed since the checkpoint); resume with the "
            "code that wrote it, or delete the file to resume with a fresh MRTPO state."
        )
    for part, entry, problem in bad:
        raise ValueError(
            f"{path}: entry {entry} is {problem}, not what {part} writes (the file is damaged or was edited); {FRESH}."
        )
    return found


class CheckpointedState:
    """MRTPO's state in a checkpoint: the run's identity and its parts' state (per-reward strength, the collapse
    monitor, the replay's memory, the credit rule, the terms), each under its part's name, which the errors use."""

    def __init__(self, identity: dict, parts: dict[str, Any]):
        self.parts, self.identity = dict(parts), dict(identity)
        for part in self.parts.values():
            self.identity.update(part.identity())

    def serialised(self) -> bytes:
        """Every part's state as the file's bytes, refused as a resume would refuse it, naming the part."""
        written = {name: part.state() for name, part in self.parts.items()}
        checks = {name: part.state_checks for name, part in self.parts.items()}
        missing, unknown, bad = entry_problems(written, checks, len(self.identity["reward_names"]))
        for name, entry in missing:
            raise ValueError(f"{name} declares the state entry {entry!r} but did not write it.")
        for name, entry in unknown:
            raise ValueError(f"{name} writes the state entry {entry!r} without declaring it (state_checks).")
        for name, entry, problem in bad:  # refused at save, before transformers writes: a resume would refuse it
            raise ValueError(
                f"{name} writes the state entry {entry!r} as {problem}; a checkpoint holding it could "
                "not be resumed from."
            )
        if not _plain(self.identity):
            raise ValueError(f"the safe loader cannot read back MRTPO's state identity {self.identity!r:.200}.")
        buffer = io.BytesIO()
        torch.save(
            {"version": STATE_VERSION, "release": version("trl-mrtpo"), "run": self.identity, "parts": written}, buffer
        )
        return buffer.getvalue()

    def write(self, checkpoint: str, process_index: int, payload: bytes | None = None) -> None:
        """This process's file in ``checkpoint``: ``payload`` (:meth:`serialised`'s, taken before the checkpoint)."""
        payload = self.serialised() if payload is None else payload  # refused before a file is opened
        with open(os.path.join(checkpoint, f"mrtpo_state_{process_index}.pt"), "wb") as file:
            file.write(payload)

    def read(self, checkpoint: str, process_index: int) -> None:
        """Restores every part from this process's file in ``checkpoint``; the core state is the same on every
        process, so a process without its own file (more processes now, or a checkpoint the main process uploaded
        alone) reads the lowest rank's. A folder with none: a warning, and the state starts afresh."""
        ranks = sorted(int(m[1]) for m in map(STATE_FILE.fullmatch, os.listdir(checkpoint)) if m)
        if not ranks:
            own = os.path.join(checkpoint, f"mrtpo_state_{process_index}.pt")
            return logger.warning(
                f"{own} is missing: MRTPO's own state (collapse monitor, per-reward strength, the credit rule's and "
                "terms') starts afresh, so the resumed run will not continue exactly as an uninterrupted one."
            )
        rank = process_index if process_index in ranks else ranks[0]
        checks = {name: part.state_checks for name, part in self.parts.items()}
        for name, state in read_credit_state(
            os.path.join(checkpoint, f"mrtpo_state_{rank}.pt"), self.identity, checks
        ).items():
            self.parts[name].restore(state)
