"""MRTPO's own checkpointed state: one file per process beside TRL's (``mrtpo_state_<rank>.pt``), namespaced by part
(``{"version", "release", "run": identity, "parts": {part: entries}}``), written each checkpoint, read back with
``torch.load(weights_only=True)`` and checked on resume, so that a resumed run continues exactly as an uninterrupted
one. Version 5 files (every part's entries in one flat dict) are still read."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Mapping
from importlib.metadata import version
from typing import Any

import torch
from transformers.utils import logging

from .rules import StateCheck

logger = logging.get_logger(__name__)

# of the mrtpo_state_<rank>.pt files in checkpoints (7 adds the replay's memory; 6 namespaces the entries by part; 4
# held TRL's generation buffer, which 5 leaves to TRL: a resume inside a buffer samples anew, as GRPOTrainer's does)
STATE_VERSION = 7


STATE_FILE = re.compile(r"mrtpo_state_(\d+)\.pt")
PartChecks = Mapping[str, Mapping[str, StateCheck]]  # part -> entry -> its check


def credit_state_path(checkpoint: str, process_index: int) -> str:
    return os.path.join(checkpoint, f"mrtpo_state_{process_index}.pt")


def _plain(value: Any) -> bool:
    """What ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, None, and lists, tuples and
    dicts of them (a numpy value, a generator or an object of one's own is not)."""
    if value is None or isinstance(value, torch.Tensor) or type(value) in (bool, int, float, str):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    return isinstance(value, dict) and all(_plain(k) and _plain(v) for k, v in value.items())


def entry_problem(value: Any, check: StateCheck, num_rewards: int) -> str | None:
    """The one check of a state entry, run where it is written and where it is read: None when ``value`` is readable
    by the safe loader and passes its part's own ``check``, else what it is instead."""
    if not _plain(value):
        return (
            f"{type(value).__name__}, which the safe loader (torch.load(weights_only=True)) cannot read back: keep "
            "tensors, numbers, strings, None, and lists or dicts of them"
        )
    return check(value, num_rewards)


def write_credit_state(checkpoint: str, process_index: int, payload: bytes) -> None:
    """Each process its own file, from :meth:`CheckpointedState.serialised`."""
    with open(credit_state_path(checkpoint, process_index), "wb") as file:
        file.write(payload)


def load_credit_state(checkpoint: str, process_index: int, identity: dict, parts: PartChecks) -> dict | None:
    """This process's state of ``checkpoint`` (:func:`read_credit_state`). The core state is the same on every
    process (per-reward strength reads the batch over all of them, the collapse monitor their means), so a process
    without its own file (a resume on more processes, or a checkpoint uploaded by the main process alone) reads the
    lowest rank's; None with a warning when the folder holds none (the state starts afresh)."""
    path = credit_state_path(checkpoint, process_index)
    if not os.path.isfile(path):
        ranks = sorted(int(m[1]) for m in map(STATE_FILE.fullmatch, os.listdir(checkpoint)) if m)
        if not ranks:
            logger.warning(
                f"{path} is missing: MRTPO's own state (collapse monitor, per-reward strength, the credit rule's and "
                "terms') starts afresh, so the resumed run will not continue exactly as an uninterrupted one."
            )
            return None
        path = credit_state_path(checkpoint, ranks[0])
    return read_credit_state(path, identity, parts)


def _namespaced(state: dict, identity: dict, parts: PartChecks) -> dict:
    """A version 4 or 5 file (flat) in version 6's shape: each entry under the part that declares it; an entry no
    part declares stays under its own name, to be refused as unknown."""
    if state["version"] == 4:  # TRL's generation buffer: left to TRL since 5
        logger.info("MRTPO state version 4: its generation buffer is ignored (the resumed run samples anew).")
        state = {key: value for key, value in state.items() if key != "generation_buffer"}
    owner = {entry: part for part, checks in parts.items() for entry in checks}
    entries = {key: value for key, value in state.items() if key not in ("version", "release", *identity)}
    namespaced = {part: {} for part in parts}
    for entry, value in entries.items():
        namespaced.setdefault(owner.get(entry, entry), {})[entry] = value
    run = {key: state[key] for key in identity if key in state}
    return {"version": STATE_VERSION, "release": state.get("release"), "run": run, "parts": namespaced}


def read_credit_state(path: str, identity: dict, parts: PartChecks) -> dict:
    """Each part's entries from the checkpointed state, loaded safely (``weights_only=True``: tensors, numbers and
    strings only) and checked against the run resuming from it: a damaged or foreign file, one written for other
    rewards or credit settings, or an entry that is missing, unknown or not what ``parts`` expects, stops with a
    message naming the file and what differs."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:
        raise ValueError(
            f"{path} cannot be read as MRTPO's checkpoint state ({type(error).__name__}: {error}). It is damaged, "
            "from another program, or from an older trl-mrtpo release; delete it to resume with a fresh MRTPO "
            "state."
        ) from error
    if not isinstance(state, dict) or "version" not in state:
        found = ", ".join(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"{path} is not an MRTPO checkpoint state (found: {found}); delete it or resume elsewhere.")
    written = state.get("version")
    if isinstance(written, int) and written > STATE_VERSION:
        raise ValueError(
            f"{path} was written by trl-mrtpo {state.get('release', 'of a later release')} (state version "
            f"{written}); this release ({version('trl-mrtpo')}) reads version {STATE_VERSION}: upgrade trl-mrtpo to "
            "resume from it."
        )
    if written in (4, 5):
        state = _namespaced(state, identity, parts)
    if written not in (4, 5, 6, STATE_VERSION) or not isinstance(state.get("parts"), dict):
        raise ValueError(
            f"{path} has MRTPO state version {written}, this release reads versions 5 to {STATE_VERSION}; "
            "delete it to resume with a fresh MRTPO state."
        )
    if written == 6:  # the parts version 7 added (the replay's memory) start afresh: None
        for part, checks in parts.items():
            state["parts"].setdefault(part, dict.fromkeys(checks))
    run = state.get("run") if isinstance(state.get("run"), dict) else {}
    differences = [
        f"{key}: {run.get(key)!r} in the checkpoint, {value!r} now"
        for key, value in identity.items()
        if run.get(key) != value
    ]
    if differences:
        # the real cause: other rewards would take the per-reward state of others; another setting, the state of
        # a rule or terms this run does not have
        cause = (
            "its per-reward state would be applied to the wrong rewards"
            if run.get("reward_names") != identity.get("reward_names")
            else "its credit state belongs to those settings (a rule's and terms' state, per-reward strength read "
            "under them), which this run does not continue"
        )
        raise ValueError(
            f"{path} was written by a run with another setup ({'; '.join(differences)}): {cause}. Resume with the "
            "same rewards and credit settings, or start a new run (resume_from_checkpoint=None)."
        )
    found = {part: entries if isinstance(entries, dict) else {} for part, entries in state["parts"].items()}
    missing = [entry for part, checks in parts.items() for entry in checks if entry not in found.get(part, {})]
    unknown = [e for part, entries in found.items() for e in map(str, entries) if e not in parts.get(part, {})]
    if missing or unknown:
        lacks = f"lacks the entry {', '.join(missing)} " if missing else ""
        holds = f"holds the entry {', '.join(sorted(unknown))} " if unknown else ""
        raise ValueError(
            f"{path}: MRTPO's state {lacks}{'and ' if lacks and holds else ''}{holds}that this run's rule and terms "
            "declare otherwise (their state changed since the checkpoint); resume with the code that wrote it, or "
            "delete the file to resume with a fresh MRTPO state."
        )
    for part, checks in parts.items():
        for entry, check in checks.items():
            problem = entry_problem(found[part][entry], check, len(identity["reward_names"]))
            if problem is not None:
                raise ValueError(
                    f"{path}: entry {entry} is {problem}, not what {part} writes (the file is damaged or was "
                    "edited); delete it to resume with a fresh MRTPO state."
                )
    return found


class CheckpointedState:
    """MRTPO's state in a checkpoint: the run's identity and its parts' state (per-reward strength, the collapse
    monitor, the credit rule, the terms), each under its part's name (which the errors use), with ``identity()``,
    ``state()``, ``restore(state)`` and ``state_checks`` (:class:`~trl_mrtpo.rules.Stateful`)."""

    def __init__(self, identity: dict, parts: dict[str, Any]):
        self.parts = dict(parts)
        self.identity = dict(identity)
        for part in self.parts.values():
            self.identity.update(part.identity())

    def write(self, checkpoint: str, process_index: int) -> None:
        """Writes :meth:`serialised` to ``checkpoint``."""
        write_credit_state(checkpoint, process_index, self.serialised())

    def serialised(self) -> bytes:
        """Every part's state as the file's bytes, refusing an entry a part declares but did not write, one it did
        not declare, or one the safe loader could not read back on resume."""
        parts = {}
        for name, part in self.parts.items():
            written = part.state()
            for entry in part.state_checks:
                if entry not in written:
                    raise ValueError(f"{name} declares the state entry {entry!r} but did not write it.")
            for entry, value in written.items():
                if entry not in part.state_checks:
                    raise ValueError(f"{name} writes the state entry {entry!r} without declaring it (state_checks).")
                problem = entry_problem(value, part.state_checks[entry], len(self.identity["reward_names"]))
                if problem is not None:  # refused at save, before transformers writes: a resume would refuse it
                    raise ValueError(
                        f"{name} writes the state entry {entry!r} as {problem}; a checkpoint holding it could not "
                        "be resumed from."
                    )
            parts[name] = written
        if not _plain(self.identity):
            raise ValueError(f"the safe loader cannot read back MRTPO's state identity {self.identity!r:.200}.")
        buffer = io.BytesIO()
        state = {"version": STATE_VERSION, "release": version("trl-mrtpo"), "run": self.identity, "parts": parts}
        torch.save(state, buffer)
        return buffer.getvalue()

    def read(self, checkpoint: str, process_index: int) -> None:
        """Restores every part from ``checkpoint`` (:func:`load_credit_state`); nothing when it holds no state."""
        checks = {name: part.state_checks for name, part in self.parts.items()}
        state = load_credit_state(checkpoint, process_index, self.identity, checks)
        for name, part in self.parts.items() if state is not None else ():
            part.restore(state[name])
