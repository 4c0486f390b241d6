"""State kept across generation batches and checkpoints (docs/architecture.md): what a part keeps
(:class:`Stateful`: the collapse monitor, per-reward strength, the replay's memory, the rule, the terms), and MRTPO's
checkpointed state, one file per process beside TRL's, ``{"version", "release", "run": identity, "parts": {part:
entries}}``, read with ``torch.load(weights_only=True)``. One check, :func:`state_problems`, runs where it is written
and where it is read, so a run's own checkpoint always resumes, as the run would have continued;
:class:`CreditCheckpoints` writes and reads it where TRL writes and reads its own."""

from __future__ import annotations

import copy
import io
import json
import os
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from transformers.utils import logging

logger = logging.get_logger(__name__)
STATE_VERSION = 8  # of the state files; a release reads its own (0.2.0 wrote version 1)
STATE_FILE = re.compile(r"mrtpo_state_(\d+)\.pt")
FRESH = "delete it to resume with a fresh MRTPO state"


class Stateful:
    """What a rule or a term keeps between generation batches and checkpoints: the entries ``state_entries`` names,
    by default attributes of those names (none)."""

    state_entries: ClassVar[tuple[str, ...]] = ()

    def identity(self) -> dict:
        """Settings a checkpoint was written under; a resume under others is refused."""
        return {}

    def state(self) -> dict:
        """The entries (tensors, numbers, strings, None, and lists or dicts of them) a resumed run needs."""
        return {entry: getattr(self, entry) for entry in self.state_entries}

    def restore(self, state: dict) -> None:
        """Sets each entry; a tensor goes to the device of the one it replaces (the state is written on the CPU)."""
        for entry in self.state_entries:
            value, current = state[entry], getattr(self, entry, None)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                value = value.to(current.device)
            setattr(self, entry, value)


def _tensors(value: Any):
    """The tensors in ``value`` (nested in lists, tuples and dicts)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in [*value.keys(), *value.values()]:
            yield from _tensors(item)


def on_cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU, as the state is written: a GPU run's checkpoint resumes anywhere."""
    if isinstance(value, torch.Tensor):
        return value if value.is_meta else value.detach().cpu()  # a meta tensor is refused by name, not moved
    if type(value) in (list, tuple):
        return type(value)(map(on_cpu, value))
    return {key: on_cpu(item) for key, item in value.items()} if type(value) is dict else value


def _same(a: Any, b: Any) -> bool:
    """Equal after a round trip: the same types (a subclass is not its base), tensors of the same dtype, shape and
    values (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).logical_or(a.isnan() & b.isnan()).all())
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[key], b[key]) for key in a)
    return a == b or (a != a and b != b)


def unreadable(value: Any) -> str | None:
    """Why ``value`` would not read back equal through ``torch.save`` and ``torch.load(weights_only=True)`` (None
    when it does): what the safe loader refuses, or reads back as another type or value, and meta tensors."""
    if any(tensor.is_meta for tensor in _tensors(value)):
        return "holds a meta tensor, which has no values to save"
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        back = torch.load(buffer, weights_only=True, map_location="cpu")
    except Exception:  # the loader's own message is about trusting a file, not about this value
        return f"is a {type(value).__name__}, which the safe loader cannot read back"
    return None if _same(value, back) else f"is a {type(value).__name__}, which reads back as a {type(back).__name__}"


def state_problems(found: dict, declared: dict) -> list[str]:
    """The one check, where the state is written and where it is read: the entries ``found`` (part -> entries) against
    those each part declares (part -> ``state_entries``), each value one that reads back equal (:func:`unreadable`)."""
    problems = []
    for part in {**declared, **found}:
        entries, names = found.get(part, {}), declared.get(part, ())
        if not isinstance(entries, dict):
            problems.append(f"{part}: its state() returned a {type(entries).__name__}, not a dict of its entries")
            continue
        problems += [f"{part}: the entry {e!r} is missing" for e in names if e not in entries]
        problems += [f"{part}: the entry {e!r} is not declared (state_entries)" for e in entries if e not in names]
        unread = [(entry, unreadable(value)) for entry, value in entries.items()]
        problems += [f"{part}: the entry {entry!r} {why}" for entry, why in unread if why is not None]
    return problems


def declaration_problems(parts: dict[str, Any]) -> list[str]:
    """What is wrong with how each part declares its state, checked where the parts are built (a term's or rule's
    mistake is named then, not at the first checkpoint after training ran): ``state_entries`` a tuple of names that
    the part has (unless its own ``state()`` gives them), and a state that reads back."""
    problems = []
    for name, part in parts.items():
        entries = part.state_entries
        if isinstance(entries, str) or not all(isinstance(entry, str) for entry in entries):
            problems.append(f"{name}: state_entries is {entries!r}; name the entries in a tuple, e.g. ({entries!r},)")
            continue
        own_state = type(part).state is not Stateful.state
        missing = [entry for entry in entries if not own_state and not hasattr(part, entry)]
        problems += [f"{name}: state_entries names {entry!r}, which it does not set" for entry in missing]
        if not missing:
            problems += state_problems({name: on_cpu(part.state())}, {name: tuple(entries)})
    return problems


def read_credit_state(path: str, identity: dict, declared: dict) -> dict:
    """Each part's entries from the file at ``path``, checked against the run resuming from it: a damaged or foreign
    file, another version, another run's rewards or credit settings, or other entries stop with the file named."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as error:
        raise ValueError(f"{path} cannot be read as MRTPO's checkpoint state ({error!r}); {FRESH}.") from error
    state = state if isinstance(state, dict) else {"version": type(state).__name__}  # a tensor or a list, say
    if (written := state.get("version")) != STATE_VERSION or not isinstance(state.get("parts"), dict):
        then = "upgrade trl-mrtpo to resume from it" if isinstance(written, int) and written > STATE_VERSION else FRESH
        raise ValueError(
            f"{path} holds MRTPO state version {written} (trl-mrtpo {state.get('release')}); this release "
            f"({version('trl-mrtpo')}) reads version {STATE_VERSION}: {then}."
        )
    run = state["run"] if isinstance(state.get("run"), dict) else {}
    differences = [f"{k}: {run.get(k)!r} in the checkpoint, {v!r} now" for k, v in identity.items() if run.get(k) != v]
    if differences:
        raise ValueError(
            f"{path} was written by a run with another setup ({'; '.join(differences)}): its state belongs to those "
            "rewards and credit settings. Resume with them, or start a new run (resume_from_checkpoint=None)."
        )
    found = {part: entries if isinstance(entries, dict) else {} for part, entries in state["parts"].items()}
    if problems := state_problems(found, declared):
        raise ValueError(f"{path}: {'; '.join(problems)}; resume with the code that wrote it, or {FRESH}.")
    return found


class CheckpointedState:
    """MRTPO's state in a checkpoint: the run's identity (with each part's) and its parts' state (per-reward
    strength, the collapse monitor, the replay's memory, the rule, the terms), each under the name errors give it."""

    def __init__(self, identity: dict, parts: dict[str, Any]):
        self.parts, self.identity = dict(parts), dict(identity)
        for part in self.parts.values():
            self.identity.update(part.identity())
        self.declared = {name: part.state_entries for name, part in self.parts.items()}

    def serialised(self) -> bytes:
        """The file's bytes, refused as a resume would refuse them, naming the part and the entry."""
        written = {name: on_cpu(part.state()) for name, part in self.parts.items()}
        plain = unreadable(self.identity) is None
        identity = [] if plain else [f"the run's identity {self.identity!r:.200} is not plain"]
        if problems := state_problems(written, self.declared) + identity:
            raise ValueError(f"{'; '.join(problems)}: a checkpoint holding it could not be resumed from.")
        buffer = io.BytesIO()
        torch.save(
            {"version": STATE_VERSION, "release": version("trl-mrtpo"), "run": self.identity, "parts": written}, buffer
        )
        return buffer.getvalue()

    def write(self, checkpoint: str, process_index: int, payload: bytes | None = None) -> None:
        """This process's file in ``checkpoint``: ``payload``, :meth:`serialised`'s taken before the checkpoint."""
        payload = self.serialised() if payload is None else payload  # refused before a file is opened
        with open(os.path.join(checkpoint, f"mrtpo_state_{process_index}.pt"), "wb") as file:
            file.write(payload)

    def read(self, checkpoint: str, process_index: int) -> str | None:
        """Restores every part from this process's file, or the lowest rank's where it has none (the core state is
        the same on every process), and returns what was restored, in words: the file, the checkpoint's step and
        the parts. A checkpoint without one: a warning, the state starts afresh, and None."""
        ranks = sorted(int(m[1]) for m in map(STATE_FILE.fullmatch, os.listdir(checkpoint)) if m)
        if not ranks:
            own = os.path.join(checkpoint, f"mrtpo_state_{process_index}.pt")
            return logger.warning(f"{own} is missing: MRTPO's own state starts afresh, unlike an uninterrupted run's.")
        path = os.path.join(checkpoint, f"mrtpo_state_{process_index if process_index in ranks else ranks[0]}.pt")
        restored = read_credit_state(path, self.identity, self.declared)
        for name, entries in restored.items():
            self.parts[name].restore(entries)
        trainer_state = Path(checkpoint, "trainer_state.json")
        step = json.loads(trainer_state.read_text()).get("global_step") if trainer_state.is_file() else None
        at = "" if step is None else f" at step {step}"
        return f"Resumed MRTPO's state{at} from {path}: {', '.join(restored)}."


class CreditCheckpoints:
    """MRTPO's state in TRL's checkpoints (:class:`CheckpointedState`): serialised before transformers writes the
    checkpoint, written beside each process's RNG state (so before a Hub upload), read back where TRL reads its own."""

    def _credit_state(self) -> CheckpointedState:
        run = {"reward_names": list(self.reward_func_names), "credit_assignment": self.args.credit_assignment}
        return CheckpointedState(run, self._stateful())

    def _save_checkpoint(self, model, trial) -> None:
        self._state_payload = None if self.args.save_only_model else self._credit_state().serialised()
        super()._save_checkpoint(model, trial)

    def _save_rng_state(self, output_dir: str) -> None:
        super()._save_rng_state(output_dir)  # only when the optimizer is saved too: never with save_only_model
        self._credit_state().write(output_dir, self.accelerator.process_index, self._state_payload)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        restored = (
            None if checkpoint is None else self._credit_state().read(checkpoint, self.accelerator.process_index)
        )
        if restored and not self.args.disable_tqdm:  # said where the first step is announced
            self.accelerator.print(restored)


@contextmanager
def left_as_it_was(trainer, windows: list[dict]) -> Iterator[None]:
    """While in the context the trainer runs as it would; after it, the run is as it was: every part's state
    (per-reward strength, the collapse streaks, the rule's and the terms'), the reward checks' early batches
    (``windows``), TRL's metrics, logs and token count, and every random generator (``sample_credit``)."""
    parts = [(part, copy.deepcopy(part.state())) for part in trainer._stateful().values()]
    windows = [(window, copy.deepcopy(window)) for window in windows]
    kept = copy.deepcopy((trainer._metrics, trainer._logs, trainer.state.num_input_tokens_seen))
    generators = random.getstate(), np.random.get_state()
    devices = [trainer.accelerator.device] if trainer.accelerator.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):  # torch's generators, the CPU's and this process's card
            yield
    finally:
        for part, state in parts:
            part.restore(state)
        for window, before in windows:
            window.clear()
            window.update(before)
        trainer._metrics, trainer._logs, trainer.state.num_input_tokens_seen = kept
        random.setstate(generators[0])
        np.random.set_state(generators[1])
