"""Checks observe, the method decides (docs/architecture.md): the maths runs without the guard, the method never reads
a value the guard returns, a batch enters the checks at a few named points, and the configuration and the state sit
at the bottom of the core."""

import ast
import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from datasets import Dataset

import trl_mrtpo
import trl_mrtpo.trainer
from tests.conftest import build_tiny_model
from tests.test_layout import imported_names
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.checks.guard import BatchGuard

PACKAGE = Path(trl_mrtpo.__file__).parent
CHECKS = PACKAGE / "checks"
# Where one replaying batch of the default run may enter checks/ from the package's own modules: the batch's rewards,
# the guard's start (with steps 1-2's weighting), the blocks, the replay contexts' length, the provider's q, the
# rule's q, the rule's weights, the final advantages. TRL's calls of the wrapped reward functions (one per reward)
# are not the method's and are counted apart.
ENTRY_CEILING = 8


class NoGuard:
    """The guard taken away: every method it has, doing nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


@pytest.mark.slow
def test_the_advantage_fingerprint_is_identical_without_the_guard(tmp_path, monkeypatch):
    """Every arm of benchmarks/advantage_fingerprint.py (each rule and term, the gym's oracle arm), with the guard and
    with an identity in its place: bit for bit the same advantages. The guard cannot change the numbers."""
    sys.path.insert(0, str(PACKAGE.parent / "benchmarks"))
    from advantage_fingerprint import fingerprint, gym_oracle_fingerprint

    def every_arm(work_dir: Path) -> dict:
        return {**fingerprint(work_dir), **gym_oracle_fingerprint(work_dir)}

    torch.set_num_threads(1)
    guarded = every_arm(tmp_path / "guarded")
    monkeypatch.setattr(trl_mrtpo.trainer, "BatchGuard", NoGuard)
    unguarded = every_arm(tmp_path / "unguarded")
    assert guarded.keys() == unguarded.keys() and len(guarded) >= 14
    for arm, steps in guarded.items():
        assert len(steps) == len(unguarded[arm]) > 0, arm
        for step, (a, b) in enumerate(zip(steps, unguarded[arm])):
            assert torch.equal(a, b), f"{arm}, step {step}"


def test_the_method_reads_nothing_the_guard_returns():
    """Each call of the guard in the trainer is a statement of its own (its value is never read), and no method of the
    guard returns a value."""
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Attribute)
        and node.func.value.attr == "_guard"
    ]
    statements = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    assert len(calls) >= 8 and all(id(call) in statements for call in calls)
    guard = ast.parse((CHECKS / "guard.py").read_text())
    (batch_guard,) = [node for node in guard.body if isinstance(node, ast.ClassDef) and node.name == "BatchGuard"]
    for method in (node for node in batch_guard.body if isinstance(node, ast.FunctionDef)):
        returned = [node for node in ast.walk(method) if isinstance(node, ast.Return) and node.value is not None]
        assert not returned, f"BatchGuard.{method.name} returns a value"
    assert {m for m in dir(BatchGuard) if not m.startswith("_")} >= {"begin", "provided", "weights", "final"}


def test_the_configuration_and_the_state_sit_at_the_bottom():
    """config.py imports only the constants and the field checks (checks/config.py imports only the constants); the
    guard no method module but the credit and the rules; the checkpointed state no module of this package."""

    def modules(path: Path) -> set[str]:  # the package's modules it imports (not the names it takes from them)
        named = {n for n in imported_names(path) if n.startswith("trl_mrtpo.")}
        return {n for n in named if PACKAGE.joinpath(*n.split(".")[1:]).with_suffix(".py").is_file()}

    assert modules(PACKAGE / "config.py") == {"trl_mrtpo.constants", "trl_mrtpo.checks.config"}
    assert modules(CHECKS / "config.py") == {"trl_mrtpo.constants"}
    assert modules(CHECKS / "guard.py") <= {
        "trl_mrtpo.constants", "trl_mrtpo.credit", "trl_mrtpo.rules", "trl_mrtpo.checks.credit_messages"
    }  # fmt: skip
    assert modules(PACKAGE / "state.py") == set()
    state = ast.parse((PACKAGE / "state.py").read_text())
    assert {"Stateful", "CheckpointedState", "CreditCheckpoints"} <= {
        node.name for node in state.body if isinstance(node, ast.ClassDef)
    }


def every_second(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def every_third(completions, **kwargs):
    return [float(i % 3 == 0) for i in range(len(completions))]


def test_a_replaying_batch_enters_the_checks_at_most_8_times(tiny_tokenizer, tmp_path):
    """The default run (MRTPOConfig's credit settings, two rewards with info blocks), its second step, which replays:
    traced with sys.setprofile, the package's own modules enter checks/ at most ENTRY_CEILING times (12 by this trace
    before the guard only looked; shown failing at 9 with a planted second call of the rule's weights check)."""
    torch.set_num_threads(1)
    args = MRTPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
        max_steps=2, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, seed=0,
    )  # fmt: skip
    rows = [{"prompt": [{"role": "user", "content": f"Name a colour {i}."}]} for i in range(4)]
    trainer = MRTPOTrainer(
        model=build_tiny_model(tiny_tokenizer),
        reward_funcs=[every_second, every_third],
        info_blocks=[lambda **_: "Mention the colour blue.", lambda **_: "Answer in under ten words."],
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tiny_tokenizer,
    )
    checks, root = str(CHECKS) + os.sep, str(PACKAGE) + os.sep
    entries, from_trl = Counter(), Counter()

    def profile(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(checks):
            return
        caller = frame.f_back.f_code.co_filename if frame.f_back is not None else ""
        if caller.startswith(checks):
            return
        where = (frame.f_code.co_name, os.path.basename(caller))
        (entries if caller.startswith(root) else from_trl)[where] += 1

    generate, seen = trainer._generate_and_score_completions, []

    def traced(inputs):
        seen.append(len(seen))
        if len(seen) != 2:
            return generate(inputs)
        sys.setprofile(profile)
        try:
            return generate(inputs)
        finally:
            sys.setprofile(None)

    trainer._generate_and_score_completions = traced
    trainer.train()
    assert trainer.state.log_history[1]["mrtpo/replayed_fraction"] > 0  # the traced batch replayed
    assert sum(from_trl.values()) == 2, from_trl  # TRL calls each wrapped reward function once
    assert sum(entries.values()) <= ENTRY_CEILING, entries
    print(f"entries into checks/ from the package: {sum(entries.values())}: {dict(entries)}")
