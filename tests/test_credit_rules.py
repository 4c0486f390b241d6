"""Credit rules and terms are data: a rule defined in this file only, registered by name, and a term defined here,
passed to the trainer, each train two steps and match a float64 reference of what they define; a rule's state goes
through the one checkpoint mechanism; a rule name is registered once; the core names nothing of the research
room."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import RecordingTrainer, make_args
from tests.reference import reference_step_credit_advantages, reference_token_advantages
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.credit import replayed_token_weights
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.relevance import Relevance
from trl_mrtpo.rules import (
    Contribution,
    CreditRule,
    CreditTerm,
    credit_rule_names,
    register_credit_rule,
    resolve_credit_rule,
    unregister_credit_rule,
)
from trl_mrtpo.scripts.inspection import sample_credit

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mrtpo"


class SquaredRelevance(CreditRule):
    """Step 5 on q squared: each reward's credit follows its own q, sharpened. Counts the batches it weighed (its
    state, checkpointed)."""

    removal = "each"
    reads = ("relevance",)
    state_entries = ("batches",)

    def __init__(self, setup):
        super().__init__(setup)
        self.batches = 0

    def weights(self, inputs):
        self.batches += 1
        return replayed_token_weights(inputs.relevance**2, inputs.replayed, inputs.batch.mask, inputs.betas)


class LaterTokens(CreditTerm):
    """A term that adds 0.05 per position to every model token; it logs a figure named like the trainer's own beta."""

    name = "later_tokens"

    def __call__(self, batch, tokenizer, num_generations, rank, trainer_state=None):
        positions = torch.arange(batch.mask.shape[1], dtype=torch.float32, device=batch.mask.device)
        return Contribution(process=0.05 * positions * batch.mask, logged=[("added", 1.0), ("beta", 7.0)])


@pytest.fixture
def squared_rule():
    register_credit_rule("squared", SquaredRelevance)
    try:
        yield "squared"
    finally:
        unregister_credit_rule("squared")


def run(tiny_model, tiny_tokenizer, output_dir, resume=None, credit_terms=None, **overrides):
    values = dict(max_steps=2, per_device_train_batch_size=8, num_generations=4, reward_strength_floor=0.003)
    values.update(overrides)
    trainer = RecordingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(output_dir, **values),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
        credit_terms=credit_terms,
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


def test_a_term_defined_in_a_test_file_adds_to_the_rule(tiny_model, tiny_tokenizer, tmp_path):
    term = LaterTokens()
    trainer = run(tiny_model, tiny_tokenizer, tmp_path, credit_terms=[term])
    assert trainer.credit_terms == {"later_tokens": term}
    logged = [h for h in trainer.state.log_history if "mrtpo/term/later_tokens/added" in h]
    assert len(logged) == 2
    # a term's figures are namespaced under its name: its "beta" is not averaged into the trainer's
    assert [h["mrtpo/term/later_tokens/beta"] for h in logged] == [7.0, 7.0]
    assert [h["mrtpo/beta"] for h in logged] == [c.beta for c in trainer.credits] == [0.5, 0.5]
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
    assert state["parts"]["the credit rule 'squared'"]["batches"] == 1
    resumed = run(
        build_tiny_model(tiny_tokenizer),
        tiny_tokenizer,
        tmp_path,
        resume=str(tmp_path / "checkpoint-1"),
        credit_assignment="squared",
    )
    assert resumed.credit_rule.batches == 2  # one restored, one weighed after the resume


def test_an_unknown_rule_is_refused_by_name_before_the_model_loads(tmp_path):
    """The configuration is plain (any name); the trainer resolves the name first, before it loads the model (a
    model id that does not exist would fail to load after)."""
    args = make_args(tmp_path, credit_assignment="sqaured")
    with pytest.raises(ValueError, match="credit_assignment='sqaured' is unknown; choose one of mrtpo, gdpo, grpo"):
        resolve_credit_rule(args)
    with pytest.raises(ValueError, match="credit_assignment='sqaured' is unknown"):
        MRTPOTrainer(model="no-such-org/no-such-model", reward_funcs=[lambda completions, **kw: [0.0]], args=args)
    with pytest.raises(TypeError, match="must be a CreditRule subclass"):
        register_credit_rule("bad", object)
    with pytest.raises(ValueError, match="'blind' reads relevance but replays nothing"):
        register_credit_rule("blind", type("Blind", (CreditRule,), {"reads": ("relevance",)}))
    assert "bad" not in credit_rule_names() and "blind" not in credit_rule_names()


def test_a_rule_name_is_registered_once(squared_rule):
    """As verl's register_adv_est: a second registration of a taken name is refused, naming what holds it (a
    dotted-path rule edited and reloaded in a notebook would otherwise keep running the old class, or replace
    another's rule without a word)."""
    taken = r"'squared' is registered already \(tests.test_credit_rules.SquaredRelevance"
    with pytest.raises(ValueError, match=taken):
        register_credit_rule(squared_rule, type("Other", (SquaredRelevance,), {}))
    with pytest.raises(ValueError, match="'mrtpo' is registered already"):
        register_credit_rule("mrtpo", SquaredRelevance)
    assert credit_rule_names().count("squared") == 1


def test_terms_are_credit_terms_with_distinct_names(tiny_model, tiny_tokenizer, tmp_path):
    from trl_mrtpo import MRTPOTrainer

    def build(terms):
        return MRTPOTrainer(model=tiny_model, reward_funcs=BASIC.rewards, args=make_args(tmp_path),
                            train_dataset=make_basic_dataset(4), processing_class=tiny_tokenizer,
                            credit_terms=terms)  # fmt: skip

    with pytest.raises(TypeError, match="credit_terms holds a function .*each entry is a CreditTerm instance"):
        build([lambda *args: None])
    with pytest.raises(ValueError, match="two credit terms are named 'later_tokens'"):
        build([LaterTokens(), LaterTokens()])


def core_modules() -> list[Path]:
    """Every module but the rooms built on the core: the research room, the gym, the kits and the commands."""
    rooms = ("research", "gym", "kits", "scripts")
    return [path for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] not in rooms]


def test_the_core_imports_and_names_nothing_of_the_research_room():
    from trl_mrtpo.research import ResearchConfig
    from trl_mrtpo.research.config import RESEARCH_CREDIT_ASSIGNMENTS
    from trl_mrtpo.research.rules import RewardWeighting, Shuffled

    core_fields = {field.name for field in dataclasses.fields(MRTPOConfig)}
    options = [field.name for field in dataclasses.fields(ResearchConfig) if field.name not in core_fields]
    names = {*options, *Shuffled.state_entries, *RewardWeighting.state_entries}
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
    assert trainer.credit_terms["reward_weighting"].trust == {}
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
    strength = state["parts"]["per-reward strength"]
    assert "shuffle_generator" not in strength
    for entry, value in (("shuffle_generator", torch.Generator().get_state()), ("stray", 1)):
        parts = {**state["parts"], "per-reward strength": {**strength, entry: value}}
        torch.save({**state, "parts": parts}, path)
        with pytest.raises(ValueError, match=f"the entry {entry!r} is not declared"):
            research_run(resume=str(tmp_path / "checkpoint-1"))


class FirstTokens:
    """A relevance provider that knows the answer: each replayed pair's q is 1 on the completion's first two model
    tokens (no policy forward)."""

    def __init__(self):
        self.joint = []

    def __call__(self, policy, record):
        self.joint.append(record.joint)
        replayed = record.varying.clone()
        relevance = torch.zeros((*replayed.shape, record.mask.shape[1]))
        relevance[..., :2] = 1.0
        relevance = relevance * record.mask[:, None, :] * replayed[..., None]
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
    assert provider.joint == [False, False]  # one context per removed block, for each generation batch
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

    first, second = type("First", (Replacing,), {"name": "first_combine"}), type("Second", (Replacing,), {})
    with pytest.raises(ValueError, match="first_combine, Second each replace steps 6-8; at most one"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
            credit_terms=[first(), second()],
        )


def test_a_registered_rule_is_chosen_from_the_command_line(tmp_path, squared_rule):
    """A script that registers a rule and parses its flags as TRL's scripts do (``TrlParser``) can choose it: the
    parser does not fix the choices when the configuration class is made; the name is resolved as the trainer does."""
    from trl import TrlParser

    (config,) = TrlParser((MRTPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--credit_assignment", squared_rule, "--use_cpu", "true"]
    )
    assert resolve_credit_rule(config) is SquaredRelevance
    (config,) = TrlParser((MRTPOConfig,)).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--credit_assignment", "sqaured", "--use_cpu", "true"]
    )
    with pytest.raises(ValueError, match="'sqaured' is unknown; choose one of mrtpo, gdpo, grpo, squared"):
        resolve_credit_rule(config)


RULE_MODULE = """
from trl_mrtpo.credit import replayed_token_weights
from trl_mrtpo.rules import CreditRule


class Sharpened(CreditRule):
    removal = "each"
    reads = ("relevance",)
    power = {power}

    def weights(self, inputs):
        return replayed_token_weights(inputs.relevance**self.power, inputs.replayed, inputs.batch.mask, inputs.betas)
"""


def test_a_rule_by_import_path_is_resolved_each_time(tmp_path, monkeypatch):
    """As TRL's script resolves ``reward_funcs``, a ``credit_assignment`` import path is imported (from the working
    directory too) where the trainer or the command resolves it, and registers nothing: the path resolved again
    after its module changed holds the new class."""
    import importlib
    import sys

    from trl_mrtpo.scripts.train import parse_recipe

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rules.py").write_text(RULE_MODULE.format(power=2))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("task: basic\ncredit_assignment: my_rules.Sharpened\nuse_cpu: true\n")
    try:
        parsed = parse_recipe(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])
        assert parsed[1].credit_assignment == "my_rules.Sharpened"
        assert resolve_credit_rule(parsed[1]).power == 2
        # the module edited (in a notebook: edit, reload), the path resolves to the new class
        (tmp_path / "my_rules.py").write_text(RULE_MODULE.format(power=3))
        sys.modules.pop("my_rules", None)
        importlib.invalidate_caches()
        assert resolve_credit_rule(make_args(tmp_path, credit_assignment="my_rules.Sharpened")).power == 3
    finally:
        sys.modules.pop("my_rules", None)
    assert "my_rules.Sharpened" not in credit_rule_names()
    with pytest.raises(ValueError, match=r"cannot import credit rule 'tests.no_such_module.Rule'"):
        resolve_credit_rule(make_args(tmp_path, credit_assignment="tests.no_such_module.Rule"))
    with pytest.raises(TypeError, match="credit rule 'tests.helpers.make_args' must be a CreditRule subclass"):
        resolve_credit_rule(make_args(tmp_path, credit_assignment="tests.helpers.make_args"))


class SubtractedMean(CreditTerm):
    """q minus 0.9 of its mean: below 0 on most tokens, under the documented floor of the weights."""

    name = "subtracted_mean"

    def relevance(self, relevance, replayed, batch):
        return relevance - 0.9 * relevance.mean(-1, keepdim=True)


class Flattened(CreditTerm):
    name = "flattened"

    def relevance(self, relevance, replayed, batch):
        return relevance.flatten(1)


@pytest.mark.parametrize(
    ("term", "message"),
    [
        (SubtractedMean(), r"the term 'subtracted_mean'.*relevance\(\) returned q below 0"),
        (Flattened(), r"the term 'flattened': relevance\(\) of shape \(8, \d+\), expected \(8, \d+, \d+\)"),
    ],
)
def test_a_terms_relevance_is_checked_for_shape_and_sign(tiny_model, tiny_tokenizer, tmp_path, term, message):
    with pytest.raises(ValueError, match=message):
        run(tiny_model, tiny_tokenizer, tmp_path, credit_terms=[term], max_steps=1, credit_warmup_steps=0)


class LearnedWeights(SquaredRelevance):
    """Weights through a parameter that requires grad (a learned rule): nothing of it may reach TRL's loss."""

    def __init__(self, setup):
        super().__init__(setup)
        self.scale = torch.nn.Parameter(torch.ones(()))

    def weights(self, inputs):
        return super().weights(inputs) * self.scale


def test_rules_and_terms_run_without_grad(tiny_model, tiny_tokenizer, tmp_path):
    """With 2 iterations a rule's graph was backpropagated twice ('backward through the graph a second time'); with 1,
    gradients flowed into the rule's parameter."""
    register_credit_rule("learned", LearnedWeights)
    try:
        trainer = run(tiny_model, tiny_tokenizer, tmp_path, credit_assignment="learned", num_iterations=2)
    finally:
        unregister_credit_rule("learned")
    assert not trainer.batches[0]["advantages"].requires_grad
    assert trainer.credit_rule.scale.grad is None


def test_one_term_instead_of_a_list_is_refused_at_construction(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(TypeError, match=r"credit_terms takes a list of CreditTerm instances; got one LaterTokens"):
        run(tiny_model, tiny_tokenizer, tmp_path, credit_terms=LaterTokens())


class QMean(CreditTerm):
    """A term named like the trainer's figure family ``q_mean``, logging a figure named like a reward."""

    name = "q_mean"

    def __call__(self, batch, tokenizer, num_generations, rank, trainer_state=None):
        return Contribution(logged=[(BASIC.rewards[0].__name__, 61.5)])


def test_a_terms_figures_overwrite_the_trainers(tiny_model, tiny_tokenizer, tmp_path):
    """Terms log in a namespace of their own (``mrtpo/term/<name>/<figure>``): a term named ``q_mean`` logging a figure
    named like a reward leaves the trainer's ``mrtpo/q_mean/<reward>`` its own (it wrote 61.5 into it)."""
    trainer = run(tiny_model, tiny_tokenizer, tmp_path, credit_terms=[QMean()])
    logged = [h for h in trainer.state.log_history if f"mrtpo/term/q_mean/{BASIC.rewards[0].__name__}" in h]
    assert [h[f"mrtpo/term/q_mean/{BASIC.rewards[0].__name__}"] for h in logged] == [61.5, 61.5]
    assert all(h.get(f"mrtpo/q_mean/{BASIC.rewards[0].__name__}", 0.0) < 1.0 for h in logged)  # q is at most 1 bit


def test_a_reward_that_is_never_replayed_still_logs_its_beta(tiny_model, tiny_tokenizer, tmp_path):
    """A reward without an info block is never replayed: it logs no ``mrtpo/beta/<reward>`` (it logged the configured
    beta, which reads as credit being moved); the rewards with a block log theirs."""
    blocks = [*BASIC.info_blocks[:-1], None]
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=blocks,
        args=make_args(tmp_path, reward_strength_floor=0.25, max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    logged = trainer.state.log_history[0]
    names = [f.__name__ for f in BASIC.rewards]
    assert f"mrtpo/beta/{names[-1]}" not in logged
    assert all(f"mrtpo/beta/{name}" in logged for name in names[:-1])
