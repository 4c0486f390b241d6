"""Bad state: checkpointed MRTPO state that is unreadable, inconsistent or written for another run is refused naming
the file and the entry; a resume without state warns and trains."""

import re
from collections import defaultdict, deque, namedtuple

import numpy as np
import pytest
import torch

from tests.helpers import make_args, train
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.rules import Contribution, CreditTerm
from trl_mrtpo.scripts.inspection import sample_credit
from trl_mrtpo.state import STATE_VERSION, CheckpointedState, read_credit_state, unreadable
from trl_mrtpo.strength import RewardStrength

# ---------------------------------------------------------------- checkpoint state
IDENTITY = {
    "reward_names": ["a", "b"],
    "credit_assignment": "mrtpo",
    "reward_weighting": "static",
    "concur_primary": 0,
}

# a research run's checkpoint: every part that keeps state, by the name the file and the errors give it
STATE_ENTRIES = {
    "the collapse monitor": ("streaks",),
    "per-reward strength": ("specificity",),
    "the credit rule 'shuffled'": ("shuffle_generator",),
    "the term 'reward_weighting'": ("concur_trust",),
    "the replay's memory": ("usable_bytes",),
}


def _entries(**changes) -> dict:
    return {
        "concur_trust": {},
        "shuffle_generator": torch.Generator().get_state(),
        "streaks": {},
        "specificity": torch.zeros(2, dtype=torch.float64),
        "usable_bytes": None,
        **changes,
    }


def _state(**changes):
    """The research run's state file, with ``changes`` to its version, its identity or its entries (an entry no part
    declares goes under per-reward strength)."""
    top = {key: changes.pop(key) for key in ("version", "release", "generation_buffer") if key in changes}
    run = {key: changes.pop(key, value) for key, value in IDENTITY.items()}
    entries = _entries(**changes)
    parts = {part: {entry: entries.pop(entry) for entry in names} for part, names in STATE_ENTRIES.items()}
    parts["per-reward strength"].update(entries)
    return {"version": STATE_VERSION, **top, "run": run, "parts": parts}


def _flat_state(version: int, **changes):
    """A version 4 or 5 file: the identity and every part's entries in one dict."""
    return {"version": version, **IDENTITY, **_entries(), **changes}


class Foreign:
    pass


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "cannot be read as MRTPO's checkpoint state"),
        (b"\x80\x04garbage", "cannot be read as MRTPO's checkpoint state"),
        (Foreign(), "cannot be read as MRTPO's checkpoint state"),  # weights_only refuses arbitrary objects
        ({"model": torch.zeros(1)}, "holds MRTPO state version None"),
        (torch.zeros(2), "holds MRTPO state version Tensor"),  # a file the safe loader reads that is not a dict
        ([1, 2], "holds MRTPO state version list"),
        (_state(version=0), "holds MRTPO state version 0"),
        (_state(reward_names=["a", "c"]), "reward_names: \\['a', 'c'\\] in the checkpoint, \\['a', 'b'\\] now"),
        (_state(credit_assignment="gdpo"), "credit_assignment: 'gdpo' in the checkpoint, 'mrtpo' now"),
        (_state(reward_weighting="concur", concur_primary=1), "reward_weighting: 'concur' .*concur_primary: 1"),
    ],
)
def test_bad_checkpoint_state_names_the_file(tmp_path, content, message):
    path = tmp_path / "mrtpo_state_0.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        torch.save(content, path)
    with pytest.raises(ValueError, match=f"{path}.*{message}"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_good_checkpoint_state_loads(tmp_path):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(), path)
    assert set(read_credit_state(str(path), IDENTITY, STATE_ENTRIES)) == set(STATE_ENTRIES)


def test_resuming_with_other_rewards_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    train(tiny_model, tiny_tokenizer, tmp_path / "run", save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"

    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards[:2],
        info_blocks=BASIC.info_blocks[:2],
        args=make_args(tmp_path / "run", max_steps=4),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    with pytest.raises(ValueError, match="mrtpo_state_0.pt was written by a run with another setup \\(reward_names"):
        trainer.train(resume_from_checkpoint=str(checkpoint))


def test_resuming_a_checkpoint_without_mrtpo_state_warns_and_trains(tiny_model, tiny_tokenizer, tmp_path, caplog):
    """A checkpoint written before MRTPO saved its state (or by GRPOTrainer) still resumes, with a warning."""
    import logging

    train(tiny_model, tiny_tokenizer, tmp_path / "run", save_strategy="steps", save_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    (checkpoint / "mrtpo_state_0.pt").unlink()

    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path / "run", max_steps=4),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 4
    assert any("mrtpo_state_0.pt is missing" in record.getMessage() for record in caplog.records)


def test_a_resume_says_nothing_about_the_mrtpo_state_it_restored(tiny_model, tiny_tokenizer, tmp_path, capsys):
    """A resume names the MRTPO state it restored: the file, the checkpoint's step and every part (it said
    nothing)."""
    train(tiny_model, tiny_tokenizer, tmp_path / "run", save_strategy="steps", save_steps=2)
    capsys.readouterr()
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path / "run", max_steps=3),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    said = capsys.readouterr().out
    parts = "the collapse monitor, the replay's memory, per-reward strength, the credit rule 'mrtpo'"
    assert (
        f"Resumed MRTPO's state at step 2 from {tmp_path / 'run' / 'checkpoint-2' / 'mrtpo_state_0.pt'}: {parts}."
        in said
    )


# ---------------------------------------------------------------- checkpoint state contents
@pytest.mark.parametrize(
    "changes, problem",
    [
        (dict(optimizer_hint=1), "per-reward strength: the entry 'optimizer_hint' is not declared"),
        (dict(streaks=np.zeros(1)), "cannot be read as MRTPO's checkpoint state"),  # the safe loader refuses it
    ],
)
def test_an_inconsistent_checkpoint_state_names_the_file_and_entry(tmp_path, changes, problem):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(**changes), path)
    with pytest.raises(ValueError, match=f"{path}.*{problem}"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_a_truncated_checkpoint_state_names_the_file(tmp_path):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(), path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"{path} cannot be read as MRTPO's checkpoint state"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_sample_credit_leaves_the_mode_and_the_strength_state_as_they_were(tiny_model, tiny_tokenizer, tmp_path):
    """What ``inspect`` calls: it read the batch into the running strength and left the model in train mode."""
    from tests.helpers import make_args
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, reward_strength_floor=0.25),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.model.eval()
    record = sample_credit(trainer, [dict(make_basic_dataset(1)[0])], 4)
    assert record.replayed.any()
    assert not trainer.model.training and torch.isnan(trainer.reward_strength.specificity).all()


@pytest.mark.parametrize("version", [3, 4, 5, 6, 7])
def test_a_state_of_a_version_no_release_wrote_is_refused_naming_the_version_read(tmp_path, version):
    """Versions 3 to 7 were written only by development builds (no release shipped them; 0.2.0 wrote 1): a release
    reads its own version, and refuses such a file with the version it reads."""
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_flat_state(version) if version < 6 else _state(version=version), path)
    with pytest.raises(
        ValueError, match=f"holds MRTPO state version {version} .* reads version {STATE_VERSION}: delete it"
    ):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_a_state_without_the_replays_memory_is_refused_and_a_decided_one_reads_back(tmp_path):
    """The replay's memory (the bytes a CUDA run sized its replay from): a file without it is refused naming the
    part and the entry; None (undecided) and a count of bytes read back as written."""
    path = tmp_path / "mrtpo_state_0.pt"
    state = _state()
    del state["parts"]["the replay's memory"]
    torch.save(state, path)
    with pytest.raises(ValueError, match="the replay's memory: the entry 'usable_bytes' is missing"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)
    for usable in (None, 6 << 30):
        torch.save(_state(usable_bytes=usable), path)
        assert read_credit_state(str(path), IDENTITY, STATE_ENTRIES)["the replay's memory"]["usable_bytes"] == usable


def test_good_input_of_every_checked_family_passes(tmp_path):
    """The checks refuse nothing a correct run gives them (a finite reward, typed fields, a proper state)."""
    import math

    from datasets import Dataset

    from trl_mrtpo.checks.batch import check_reward_values
    from trl_mrtpo.steps.process_rewards import checked_steps

    assert check_reward_values("r", [0.0, 3e38, None], 3) == [0.0, 3e38, None]
    assert make_args(tmp_path, reward_weights=[1, 2.5], credit_beta=1).credit_beta == 1
    path = tmp_path / "mrtpo_state_0.pt"
    trust = {"1": {"count": 3, "total": 1.0, "total_squares": 1.0, "min_readings": 4}}
    torch.save(_state(concur_trust=trust, streaks={"a": 2}), path)
    assert (
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)["the term 'reward_weighting'"]["concur_trust"] == trust
    )
    assert math.isfinite(checked_steps([(0, 1, 3e38)], "p", 0, "ab")[0].score)
    Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])


# ---------------------------------------------------------------- state that is saved can be restored
class Part:
    """A rule's or term's state: ``entries`` declared, ``state`` written."""

    def __init__(self, entries: tuple, state: dict):
        self.state_entries, self._state, self.restored = entries, state, None

    def identity(self):
        return {}

    def state(self):
        return dict(self._state)

    def restore(self, state):
        self.restored = {key: state[key] for key in self.state_entries}


RUN = {"reward_names": ["a", "b"], "credit_assignment": "mrtpo"}
Pair = namedtuple("Pair", "first second")


class Memo:
    pass


@pytest.mark.parametrize(
    "value", [np.zeros(2), deque([1, 2]), torch.Generator(), Memo()], ids=["numpy", "deque", "generator", "object"]
)
def test_an_entry_the_safe_loader_cannot_read_is_refused_when_written(tmp_path, value):
    """Saved without a word before, then the resume called the whole file damaged and dropped all of MRTPO's state."""
    from trl_mrtpo.state import CheckpointedState

    state = CheckpointedState(RUN, {"the term 'memo'": Part(("memo",), {"memo": value})})
    with pytest.raises(ValueError, match=r"the term 'memo': the entry 'memo' is a .*, which the safe loader cannot"):
        state.write(str(tmp_path), 0)
    assert not (tmp_path / "mrtpo_state_0.pt").exists()


def test_an_entry_declared_but_never_written_is_refused_when_written(tmp_path):
    from trl_mrtpo.state import CheckpointedState

    state = CheckpointedState(RUN, {"the term 'memo'": Part(("memo", "count"), {"memo": 1})})
    with pytest.raises(ValueError, match=r"the term 'memo': the entry 'count' is missing: a checkpoint holding"):
        state.write(str(tmp_path), 0)


def test_two_parts_may_name_an_entry_alike():
    """Each part's entries are its own (the file is namespaced by part): two parts that both keep a ``count``, or an
    entry named like the file's own keys, round-trip apart (in one flat dict they overwrote each other)."""
    import io

    from trl_mrtpo.state import CheckpointedState

    first, second = (
        Part(("count", "version"), {"count": 1, "version": "a"}),
        Part(("count",), {"count": 2}),
    )
    payload = CheckpointedState(RUN, {"the term 'first'": first, "the term 'second'": second}).serialised()
    parts = torch.load(io.BytesIO(payload), weights_only=True)["parts"]
    assert parts == {"the term 'first'": {"count": 1, "version": "a"}, "the term 'second'": {"count": 2}}


def test_a_state_written_by_a_newer_release_says_to_upgrade(tmp_path):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(version=STATE_VERSION + 1, release="9.9.9"), path)
    message = rf"holds MRTPO state version {STATE_VERSION + 1} \(trl-mrtpo 9.9.9\).*upgrade trl-mrtpo to resume"
    with pytest.raises(ValueError, match=message):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_every_entry_type_the_docs_allow_round_trips(tmp_path):
    """Tensors (float, integer, bool), numbers, strings, booleans, None, and lists and dicts of them: back equal."""
    from trl_mrtpo.state import CheckpointedState

    values = {
        "floats": torch.tensor([0.5, float("nan")], dtype=torch.float64), "ints": torch.arange(3),
        "flags": torch.tensor([True, False]), "count": 7, "rate": 0.25, "label": "x", "on": True, "none": None,
        "listed": [1, 2.5, "y", torch.ones(2)], "nested": {"a": {"b": [torch.zeros(1), 3]}},
    }  # fmt: skip
    written = Part(tuple(values), values)
    CheckpointedState(RUN, {"the term 'every'": written}).write(str(tmp_path), 0)
    read = Part(tuple(values), {})
    CheckpointedState(RUN, {"the term 'every'": read}).read(str(tmp_path), 0)
    for key, value in values.items():
        got = read.restored[key]
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(got, value, equal_nan=True)
        elif key in ("listed", "nested"):
            assert repr(got) == repr(value), key
        else:
            assert got == value, key


class Unsaveable(MRTPOTrainer):
    """A run whose MRTPO state comes to hold a value the safe loader cannot read back (a rule's numpy array, say),
    after the construction-time check passed it."""

    memo = 0

    def _stateful(self):
        return {**super()._stateful(), "the term 'memo'": Part(("memo",), {"memo": self.memo})}


def test_a_checkpoint_is_not_written_without_mrtpo_state(tiny_model, tiny_tokenizer, tmp_path):
    """The state is checked and serialised before transformers writes the checkpoint: the refusal leaves no folder
    holding the model without MRTPO's state (transformers had written checkpoint-1 first)."""
    trainer = Unsaveable(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=1, save_strategy="steps", save_steps=1),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    trainer.memo = np.zeros(2)
    with pytest.raises(ValueError, match=r"the term 'memo': the entry 'memo' is a ndarray"):
        trainer.train()
    assert not (tmp_path / "checkpoint-1").exists()


def test_a_resume_refusal_names_the_missing_and_extra_entries(tmp_path):
    from trl_mrtpo.state import CheckpointedState

    CheckpointedState(RUN, {"the term 'memo'": Part(("memo", "old"), {"memo": 1, "old": 2})}).write(str(tmp_path), 0)
    grown = Part(("memo", "count"), {})
    with pytest.raises(ValueError, match=r"the entry 'count' is missing; .*the entry 'old' is not declared"):
        CheckpointedState(RUN, {"the term 'memo'": grown}).read(str(tmp_path), 0)


def test_resuming_under_another_mode_names_the_mode_not_the_rewards(tmp_path):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(credit_assignment="mrtpo"), path)
    with pytest.raises(ValueError, match="credit_assignment: 'mrtpo' in the checkpoint, 'gdpo' now") as refused:
        read_credit_state(str(path), {**IDENTITY, "credit_assignment": "gdpo"}, STATE_ENTRIES)
    assert "reward_names" not in str(refused.value)


def test_sample_credit_moves_the_run(tiny_tokenizer, tmp_path):
    """The public ``MRTPOTrainer.sample_credit`` leaves the run as it was: a ``train()`` after it gives the advantages,
    the per-reward strength, the logged metrics and the weights of a ``train()`` without it, bit for bit (it advanced
    the strength, the collapse streaks, the rewards' early batches and the random generators)."""
    from tests.conftest import build_tiny_model
    from tests.helpers import make_args, recording_trainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    def run(sample_first: bool):
        trainer = recording_trainer(
            model=build_tiny_model(tiny_tokenizer),
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path / str(sample_first), reward_strength_floor=0.25, max_steps=1),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )
        if sample_first:
            trainer.sample_credit([dict(make_basic_dataset(1)[0]) for _ in range(4)])
            trainer.batches.clear()
        trainer.train()
        return trainer

    alone, after = run(False), run(True)
    assert torch.equal(alone.batches[0]["advantages"], after.batches[0]["advantages"])
    strengths = alone.reward_strength.specificity, after.reward_strength.specificity
    assert torch.allclose(*strengths, rtol=0, atol=0, equal_nan=True)
    timed = re.compile(r"second|time|share")  # wall-clock figures differ from run to run
    logged = [{k: v for k, v in t.state.log_history[0].items() if not timed.search(k)} for t in (alone, after)]
    assert logged[0] == logged[1] and "mrtpo/replayed_fraction" in logged[0]
    for a, b in zip(alone.model.parameters(), after.model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "value",
    [Pair(1, 2), defaultdict(list, {"a": [1]}), torch.empty(2, device="meta")],
    ids=["namedtuple", "defaultdict", "meta"],
)
def test_a_terms_state_that_the_save_check_passes_but_the_resume_refuses(tmp_path, value):
    """A namedtuple, a defaultdict (subclasses the save-side check took for a tuple and a dict) or a meta tensor
    (no values): each is refused where the state is written, naming the part and the entry, instead of a file whose
    resume refuses every part's state; what the check accepts reads back equal."""
    state = CheckpointedState(RUN, {"the term 'memo'": Part(("memo",), {"memo": value})})
    with pytest.raises(ValueError, match=r"the term 'memo': the entry 'memo' (is a \w+, which|holds a meta tensor)"):
        state.write(str(tmp_path), 0)
    assert not list(tmp_path.iterdir())
    kept = {"memo": {"nan": torch.tensor([1.0, float("nan")]), "pair": (1, 2.5), "names": ["a", None], "n": 3}}
    CheckpointedState(RUN, {"the term 'memo'": Part(("memo",), kept)}).write(str(tmp_path), 0)
    back = Part(("memo",), {})
    CheckpointedState(RUN, {"the term 'memo'": back}).read(str(tmp_path), 0)
    assert unreadable(back.restored["memo"]) is None and repr(back.restored) == repr(kept)


def test_a_terms_cuda_tensor_makes_the_checkpoint_unreadable_on_a_cpu_machine(tmp_path, monkeypatch):
    """A GPU run's state file (its storages tagged cuda:0, as ``torch.save`` tags a CUDA tensor's; stood in by a
    tagger, no GPU in CI) resumes on a machine without one: the state is read onto the CPU, and each part moves a
    restored tensor to the device of the one it replaces."""

    def as_cuda(storage):
        return "cuda:0"

    registry = torch.serialization._package_registry
    torch.serialization.register_package(1, as_cuda, lambda storage, location: None)
    monkeypatch.setattr(torch.serialization, "_package_registry", registry)
    try:
        CheckpointedState(RUN, {"per-reward strength": RewardStrength(0.25, 2)}).write(str(tmp_path), 0)
    finally:
        registry[:] = [entry for entry in registry if entry[1] is not as_cuda]
    with pytest.raises(RuntimeError, match="CUDA"):  # what a plain load of that file does here
        torch.load(tmp_path / "mrtpo_state_0.pt", weights_only=True)
    strength = RewardStrength(0.25, 2)
    CheckpointedState(RUN, {"per-reward strength": strength}).read(str(tmp_path), 0)
    assert strength.specificity.device.type == "cpu" and strength.specificity.isnan().all()


class Tally(CreditTerm):
    """A term keeping a tally between batches, its declaration set per test."""

    name = "tally"

    def __call__(self, batch, tokenizer, num_generations, rank, trainer_state=None):
        return Contribution()


@pytest.mark.parametrize(
    "declared, named",
    [
        ({"state_entries": ("tally",)}, "the term 'tally': state_entries names 'tally', which it does not set"),
        ({"state_entries": "tally"}, r"the term 'tally': state_entries is 'tally'; name the entries in a tuple"),
        (
            {"state_entries": ("tally",), "state": lambda self: [1]},
            "the term 'tally': its state\\(\\) returned a list",
        ),
    ],
    ids=["never set", "a string", "state() a list"],
)
def test_a_terms_state_entries_fail_with_a_bare_attribute_error_at_the_first_checkpoint(
    tiny_model, tiny_tokenizer, tmp_path, declared, named
):
    """Named where the term is built, before training runs (it failed at the first checkpoint, after training, with a
    bare AttributeError naming no term)."""
    term = type("Declared", (Tally,), declared)
    with pytest.raises(ValueError, match=named):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
            credit_terms=[term()],
        )
