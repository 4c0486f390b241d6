"""Credit rules and terms are data: a rule and a term defined in this file only, registered by name, each train two
steps and match a float64 reference of what they define; a rule's state goes through the one checkpoint mechanism;
the core names nothing of the research room."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import RecordingTrainer, make_args
from tests.reference import reference_step_credit_advantages, reference_token_advantages
from trl_mrtpo import MRTPOConfig
from trl_mrtpo.credit import replayed_token_weights
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.relevance import Relevance
from trl_mrtpo.rules import (
    CreditRule,
    credit_rule_names,
    quantity,
    register_credit_rule,
    register_credit_term,
    unregister_credit_rule,
    unregister_credit_term,
)
from trl_mrtpo.scripts.inspection import sample_credit

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mrtpo"


class SquaredRelevance(CreditRule):
    """Step 5 on q squared: each reward's credit follows its own q, sharpened. Counts the batches it weighed (its
    state, checkpointed)."""

    removal = "each"
    reads = ("relevance",)
    state_checks = {"squared_batches": lambda value, num_rewards: None if isinstance(value, int) else repr(value)}

    def __init__(self, setup):
        super().__init__(setup)
        self.batches = 0

    def weights(self, inputs):
        self.batches += 1
        return replayed_token_weights(inputs.relevance**2, inputs.replayed, inputs.batch.mask, inputs.betas)

    def state(self):
        return {"squared_batches": self.batches}

    def restore(self, state):
        self.batches = state["squared_batches"]


def later_tokens(batch, tokenizer, num_generations, rank, trainer_state=None):
    """A term as a plain function: adds 0.05 per position to every model token, logged as mrtpo/later_tokens."""
    positions = torch.arange(batch.mask.shape[1], dtype=torch.float32, device=batch.mask.device)
    return {"process": 0.05 * positions * batch.mask, "failure_suffix": None}, [("later_tokens", 1.0)]


@pytest.fixture
def squared_rule():
    register_credit_rule("squared", SquaredRelevance)
    try:
        yield "squared"
    finally:
        unregister_credit_rule("squared")


@pytest.fixture
def later_tokens_term():
    register_credit_term("later_tokens", lambda setup: later_tokens)
    try:
        yield later_tokens
    finally:
        unregister_credit_term("later_tokens")


def run(tiny_model, tiny_tokenizer, output_dir, resume=None, **overrides):
    values = dict(max_steps=2, per_device_train_batch_size=8, num_generations=4, reward_strength_floor=0.003)
    values.update(overrides)
    trainer = RecordingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(output_dir, **values),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def reference(trainer, credit, q):
    c = trainer.reward_weights.double()
    return reference_token_advantages(credit.rewards.double(), q, credit.mask, c, credit.reward_betas, 2.0, G=4)[0]


def test_a_rule_registered_in_a_test_file_trains_and_matches_its_reference(
    tiny_model, tiny_tokenizer, tmp_path, squared_rule
):
    assert "squared" in credit_rule_names()
    trainer = run(tiny_model, tiny_tokenizer, tmp_path, credit_assignment="squared")
    assert isinstance(trainer.credit_rule, SquaredRelevance) and trainer.credit_rule.batches == 2
    for credit in trainer.credits:
        assert credit.replayed.any() and credit.beta == 0.5
        # the rule's own definition in float64: MRTPO's steps 1-8 on q squared, each reward's beta as trained
        expected = reference(trainer, credit, credit.relevance.double() ** 2)
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)
        # and not MRTPO's: the squared weights moved the advantages
        mrtpo = reference(trainer, credit, credit.relevance.double())
        assert (credit.advantages.double() - mrtpo).abs().max() > 1e-3


def test_a_term_registered_in_a_test_file_adds_to_the_rule(tiny_model, tiny_tokenizer, tmp_path, later_tokens_term):
    trainer = run(tiny_model, tiny_tokenizer, tmp_path)
    assert trainer.credit_terms["later_tokens"].add is later_tokens
    logged = [h for h in trainer.state.log_history if "mrtpo/later_tokens" in h]
    assert len(logged) == 2
    for credit in trainer.credits:
        positions = torch.arange(credit.mask.shape[1], dtype=torch.float64)
        expected = reference_step_credit_advantages(
            credit.rewards.double(),
            credit.relevance.double(),
            credit.mask,
            trainer.reward_weights.double(),
            credit.reward_betas,
            2.0,
            4,
            process=0.05 * positions * credit.mask,
        )
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)


def test_a_rules_state_is_checkpointed_and_restored(tiny_tokenizer, tmp_path, squared_rule):
    from tests.conftest import build_tiny_model

    run(
        build_tiny_model(tiny_tokenizer),
        tiny_tokenizer,
        tmp_path,
        credit_assignment="squared",
        save_strategy="steps",
        save_steps=1,
    )
    state = torch.load(tmp_path / "checkpoint-1" / "mrtpo_state_0.pt", weights_only=True)
    assert state["squared_batches"] == 1
    resumed = run(
        build_tiny_model(tiny_tokenizer),
        tiny_tokenizer,
        tmp_path,
        resume=str(tmp_path / "checkpoint-1"),
        credit_assignment="squared",
    )
    assert resumed.credit_rule.batches == 2  # one restored, one weighed after the resume


def test_an_unknown_rule_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="credit_assignment='sqaured' is unknown; choose one of mrtpo, gdpo, grpo"):
        make_args(tmp_path, credit_assignment="sqaured")
    with pytest.raises(TypeError, match="must be a CreditRule subclass"):
        register_credit_rule("bad", object)
    with pytest.raises(ValueError, match="'blind' reads relevance but replays nothing"):
        register_credit_rule("blind", type("Blind", (CreditRule,), {"reads": ("relevance",)}))
    assert "bad" not in credit_rule_names() and "blind" not in credit_rule_names()
    with pytest.raises(ValueError, match="no provider of the quantity 'entropy' is registered"):
        quantity("entropy")


def core_modules() -> list[Path]:
    """Every module but the rooms built on the core: the research room, the gym, the kits and the commands."""
    rooms = ("research", "gym", "kits", "scripts")
    return [path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in rooms]


def test_the_core_imports_and_names_nothing_of_the_research_room():
    from trl_mrtpo.research import ResearchConfig
    from trl_mrtpo.research.config import RESEARCH_CREDIT_ASSIGNMENTS
    from trl_mrtpo.research.rules import RESEARCH_STATE_ENTRIES

    core_fields = {field.name for field in dataclasses.fields(MRTPOConfig)}
    options = [field.name for field in dataclasses.fields(ResearchConfig) if field.name not in core_fields]
    names = {*options, *RESEARCH_STATE_ENTRIES}
    assert len(options) >= 14
    found = []
    for path in core_modules():
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and "research" in (node.module or ""):
                found.append(f"{path.name} imports {node.module}")
            if isinstance(node, ast.Constant) and node.value in RESEARCH_CREDIT_ASSIGNMENTS:
                found.append(f"{path.name} names the rule {node.value!r}")
        found += [f"{path.name} names {word}" for word in names if re.search(rf"\b{word}\b", source, re.IGNORECASE)]
    assert not found, found


def test_sample_credit_leaves_every_rule_and_term_state_as_it_was(tiny_model, tiny_tokenizer, tmp_path):
    """``inspect`` trains nothing: CONCUR's trust (a term's state) and the shuffled ablation's generator (a rule's)
    are as they were after sampling a batch's credit (they advanced before)."""
    from trl_mrtpo.research import ResearchTrainer

    trainer = ResearchTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, credit_assignment="shuffled", reward_weighting="concur"),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    generator = trainer.credit_rule.generator.get_state()
    record = sample_credit(trainer, [dict(row) for row in make_basic_dataset(2)], 4)
    assert record.replayed.any()
    assert trainer._concur_trust == {}
    assert torch.equal(trainer.credit_rule.generator.get_state(), generator)


def test_a_checkpoint_entry_this_runs_rule_and_terms_do_not_write_is_refused(tiny_tokenizer, tmp_path):
    """A state entry is read only by the rule or term that writes it: another rule's entry (the shuffled ablation's
    generator, in a run of the default rule) and an entry no rule writes are refused, naming the entry."""
    from tests.conftest import build_tiny_model
    from trl_mrtpo.research import ResearchTrainer

    def research_run(resume=None):
        trainer = ResearchTrainer(
            model=build_tiny_model(tiny_tokenizer),
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path, research=True, save_strategy="steps", save_steps=1),
            train_dataset=make_basic_dataset(8),
            processing_class=tiny_tokenizer,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    research_run()
    path = tmp_path / "checkpoint-1" / "mrtpo_state_0.pt"
    state = torch.load(path, weights_only=True)
    assert "shuffle_generator" not in state
    for entry, value in (("shuffle_generator", torch.Generator().get_state()), ("stray", 1)):
        torch.save({**state, entry: value}, path)
        with pytest.raises(ValueError, match=f"entry {entry} is unknown"):
            research_run(resume=str(tmp_path / "checkpoint-1"))


class FirstTokens:
    """A relevance provider that knows the answer: each replayed pair's q is 1 on the completion's first two model
    tokens (no policy forward)."""

    def __init__(self):
        self.removals = []

    def __call__(self, trainer, batch, removal):
        self.removals.append(removal)
        replayed = batch.varying.clone()
        relevance = torch.zeros((*replayed.shape, batch.mask.shape[1]))
        relevance[..., :2] = 1.0
        relevance = relevance * batch.mask[:, None, :] * replayed[..., None]
        return Relevance(relevance, replayed, True)


def test_a_relevance_provider_replaces_the_replay(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    import trl_mrtpo.relevance

    monkeypatch.setattr(trl_mrtpo.relevance, "replay_relevance", lambda *a, **k: pytest.fail("the policy replayed"))
    provider = FirstTokens()
    trainer = RecordingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, per_device_train_batch_size=8, num_generations=4),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
        relevance_provider=provider,
    )
    trainer.train()
    assert provider.removals == ["each", "each"]
    for credit in trainer.credits:
        assert credit.replayed.any() and (credit.relevance[..., 2:] == 0).all()
        torch.testing.assert_close(
            credit.advantages.double(),
            reference(trainer, credit, credit.relevance.double()),
            atol=2e-5,
            rtol=2e-5,
        )


def test_two_terms_that_replace_steps_6_to_8_are_refused(tiny_model, tiny_tokenizer, tmp_path):
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.rules import CreditTerm

    class Replacing(CreditTerm):
        combine = staticmethod(lambda *args, **kwargs: None)

    for name in ("first_combine", "second_combine"):
        register_credit_term(name, lambda setup: Replacing())
    try:
        with pytest.raises(ValueError, match="first_combine, second_combine each replace steps 6-8; at most one"):
            MRTPOTrainer(
                model=tiny_model,
                reward_funcs=BASIC.rewards,
                info_blocks=BASIC.info_blocks,
                args=make_args(tmp_path),
                train_dataset=make_basic_dataset(4),
                processing_class=tiny_tokenizer,
            )
    finally:
        unregister_credit_term("first_combine")
        unregister_credit_term("second_combine")


def test_a_registered_rule_is_chosen_from_the_command_line(tmp_path, squared_rule):
    """A script that registers a rule and parses its flags as TRL's scripts do (``TrlParser``) can choose it: the
    parser does not fix the choices when the configuration class is made; ``__post_init__`` checks the name."""
    from trl import TrlParser

    (config,) = TrlParser((MRTPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--credit_assignment", squared_rule, "--use_cpu", "true"]
    )
    assert config.credit_assignment == "squared"
    with pytest.raises(ValueError, match="'sqaured' is unknown; choose one of mrtpo, gdpo, grpo, squared"):
        TrlParser((MRTPOConfig,)).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--credit_assignment", "sqaured", "--use_cpu", "true"]
        )


def test_a_rule_named_by_its_import_path_is_imported_and_registered(tmp_path, tiny_model, tiny_tokenizer):
    """As TRL's ``reward_funcs`` take dotted paths, ``credit_assignment`` may name a ``CreditRule`` subclass by its
    import path (how a recipe or ``trl-mrtpo train`` selects a rule of one's own): it is imported, registered under
    that path and trained with; a path that does not import, or that is not a rule, is refused by name."""
    path = "tests.test_credit_rules.SquaredRelevance"
    try:
        trainer = run(tiny_model, tiny_tokenizer, tmp_path, max_steps=1, credit_assignment=path)
        assert isinstance(trainer.credit_rule, SquaredRelevance) and trainer.credit_rule.batches == 1
        assert path in credit_rule_names()
        from trl_mrtpo.scripts.train import make_parser

        parsed = make_parser().parse_args_and_config(
            ["--output_dir", str(tmp_path), "--credit_assignment", path, "--use_cpu", "true", "--task", "basic"]
        )
        assert parsed[1].credit_assignment == path
    finally:
        unregister_credit_rule(path)
    with pytest.raises(ValueError, match=r"credit_assignment='tests.no_such_module.Rule' is not a registered rule.*"):
        make_args(tmp_path, credit_assignment="tests.no_such_module.Rule")
    with pytest.raises(TypeError, match="credit rule 'tests.helpers.make_args' must be a CreditRule subclass"):
        make_args(tmp_path, credit_assignment="tests.helpers.make_args")
    assert "tests.helpers.make_args" not in credit_rule_names()
