"""MRTPO's own checkpointed state (``mrtpo_state_<rank>.pt`` beside TRL's files): written each checkpoint, read
back and checked on resume, so that a resumed run continues exactly as an uninterrupted one."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)

# of the mrtpo_state_<rank>.pt files in checkpoints (4 held TRL's generation buffer, which 5 leaves to TRL: a resume
# inside a buffer samples anew, as GRPOTrainer's does; a version-4 file is read without it)
STATE_VERSION = 5

# An entry's check: None when the value is what the trainer writes, else what was found instead (for the message).
StateCheck = Callable[[Any, int], "str | None"]


def collapse_streaks_problem(streaks: Any, num_rewards: int) -> str | None:
    """The collapse monitor's streaks: reward name -> a count of steps."""
    if isinstance(streaks, dict) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in streaks.values()
    ):
        return None
    return str(streaks)


def specificity_problem(specificity: Any, num_rewards: int) -> str | None:
    """The per-reward strength's running specificity: one float per reward in [0, 1] (a mean of ``1 - cos`` of
    non-negative profiles), NaN for no reading yet. Anything else would hold a reward at full beta or at rest for
    good."""
    if not (
        isinstance(specificity, torch.Tensor)
        and specificity.is_floating_point()
        and tuple(specificity.shape) == (num_rewards,)
    ):
        return f"{getattr(specificity, 'shape', type(specificity).__name__)} (one value per reward: {num_rewards})"
    read = specificity[~torch.isnan(specificity)]
    if ((read < 0) | (read > 1)).any():  # inf and -inf included
        return f"{specificity.tolist()} (each in [0, 1], or NaN before a first reading)"
    return None


CORE_STATE_ENTRIES: dict[str, StateCheck] = {
    "collapse_streaks": collapse_streaks_problem,
    "reward_specificity": specificity_problem,
}


STATE_FILE = re.compile(r"mrtpo_state_(\d+)\.pt")


def credit_state_path(checkpoint: str, process_index: int) -> str:
    return os.path.join(checkpoint, f"mrtpo_state_{process_index}.pt")


def serialised_state(identity: dict, state: dict) -> bytes | None:
    """The state file's bytes (the release that wrote it named in it), or None when ``torch.load(weights_only=True)``
    could not read them back: tensors, numbers, strings, None, and lists, tuples and dicts of them only."""
    buffer = io.BytesIO()
    torch.save({"version": STATE_VERSION, "release": version("trl-mrtpo"), **identity, **state}, buffer)
    try:
        torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception:
        return None
    return buffer.getvalue()


def write_credit_state(checkpoint: str, process_index: int, payload: bytes) -> None:
    """Each process its own file, from :meth:`CheckpointedState.serialised`."""
    with open(credit_state_path(checkpoint, process_index), "wb") as file:
        file.write(payload)


def load_credit_state(
    checkpoint: str,
    process_index: int,
    identity: dict,
    entries: dict[str, StateCheck],
) -> dict | None:
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
    return read_credit_state(path, identity, entries)


def read_credit_state(path: str, identity: dict, entries: dict[str, StateCheck]) -> dict:
    """The trainer's checkpointed state, loaded safely (``weights_only=True``: tensors, numbers and strings only)
    and checked against the run resuming from it: a damaged or foreign file, one written for other rewards or
    credit settings, or an entry that is missing, unknown or not what ``entries`` expects, stops with a message
    naming the file and what differs."""
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:
        raise ValueError(
            f"{path} cannot be read as MRTPO's checkpoint state ({type(error).__name__}: {error}). It is damaged, "
            "from another program, or from an older trl-mrtpo release; delete it to resume with a fresh MRTPO "
            "state."
        ) from error
    if isinstance(state, dict) and state.get("version") == 4:  # TRL's generation buffer: left to TRL since 5
        logger.info(f"{path}: version 4; its generation buffer is ignored (the resumed run samples anew).")
        state = {key: value for key, value in state.items() if key != "generation_buffer"} | {"version": 5}
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
    if written != STATE_VERSION:
        raise ValueError(
            f"{path} has MRTPO state version {written}, this release reads version {STATE_VERSION}; "
            "delete it to resume with a fresh MRTPO state."
        )
    differences = [
        f"{key}: {state.get(key)!r} in the checkpoint, {value!r} now"
        for key, value in identity.items()
        if state.get(key) != value
    ]
    if differences:
        raise ValueError(
            f"{path} was written by a run with another setup ({'; '.join(differences)}); its per-reward state "
            "would be applied to the wrong rewards. Resume with the same rewards and credit settings, or start a "
            "new run."
        )

    def refuse(entry: str, found: Any) -> None:
        raise ValueError(
            f"{path}: entry {entry} is {found!s:.80}, not what MRTPO writes; delete the file to resume "
            "with a fresh MRTPO state."
        )

    missing = [key for key in entries if key not in state]
    unknown = sorted(map(str, set(state) - {"version", "release", *entries, *identity}))
    if missing or unknown:
        lacks = f"lacks the entry {', '.join(missing)} " if missing else ""
        holds = f"holds the entry {', '.join(unknown)} " if unknown else ""
        raise ValueError(
            f"{path}: MRTPO's state {lacks}{'and ' if lacks and holds else ''}{holds}that this run's rule and terms "
            "declare otherwise (their state changed since the checkpoint); resume with the code that wrote it, or "
            "delete the file to resume with a fresh MRTPO state."
        )
    num_rewards = len(identity["reward_names"])
    for entry, check in entries.items():
        problem = check(state[entry], num_rewards)
        if problem is not None:
            refuse(entry, problem)
    return state


class CheckpointedState:
    """MRTPO's state in a checkpoint: the run's identity and its parts' state (per-reward strength, the collapse
    monitor, the credit rule, the terms), each part named (for the errors) with ``identity()``, ``state()``,
    ``restore(state)`` and ``state_checks`` (:class:`~trl_mrtpo.rules.Stateful`). Each entry has one owner: an entry
    two parts declare, or one named like the file's own keys, is refused when the state is assembled."""

    def __init__(self, identity: dict, parts: dict[str, Any]):
        self.parts = dict(parts)
        self.identity = dict(identity)
        for part in self.parts.values():
            self.identity.update(part.identity())
        owners = {key: "the state file itself" for key in ("version", "release", *self.identity)}
        for name, part in self.parts.items():
            for entry in part.state_checks:
                if entry in owners:
                    raise ValueError(
                        f"the state entry {entry!r} of {name} is also {owners[entry]}'s; give it another name."
                    )
                owners[entry] = name

    def write(self, checkpoint: str, process_index: int) -> None:
        """Writes :meth:`serialised` to ``checkpoint``."""
        write_credit_state(checkpoint, process_index, self.serialised())

    def serialised(self) -> bytes:
        """Every part's state as the file's bytes, refusing an entry a part declares but did not write, one it did
        not declare, or one the safe loader could not read back on resume (checked once for the whole state; entry
        by entry only to name the one at fault)."""
        state = {}
        for name, part in self.parts.items():
            written = part.state()
            for entry in part.state_checks:
                if entry not in written:
                    raise ValueError(f"{name} declares the state entry {entry!r} but did not write it.")
            for entry in written:
                if entry not in part.state_checks:
                    raise ValueError(f"{name} writes the state entry {entry!r} without declaring it (state_checks).")
            state.update(written)
        payload = serialised_state(self.identity, state)
        if payload is None:
            owner = {entry: name for name, part in self.parts.items() for entry in part.state_checks}
            for entry, value in state.items():
                if serialised_state({}, {entry: value}) is None:
                    raise ValueError(
                        f"{owner[entry]} writes the state entry {entry!r} as {type(value).__name__}, which the safe "
                        "loader (torch.load(weights_only=True)) cannot read back: keep tensors, numbers, strings, "
                        "None, and lists or dicts of them."
                    )
            raise ValueError(f"the safe loader cannot read back MRTPO's state identity {self.identity!r:.200}.")
        return payload

    def read(self, checkpoint: str, process_index: int) -> None:
        """Restores every part from ``checkpoint`` (:func:`load_credit_state`); nothing when it holds no state."""
        entries = {key: check for part in self.parts.values() for key, check in part.state_checks.items()}
        state = load_credit_state(checkpoint, process_index, self.identity, entries)
        for part in self.parts.values() if state is not None else ():
            part.restore(state)
