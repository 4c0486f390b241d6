"""Bad credit: nothing non-finite reaches the optimizer. A NaN or infinity in q (a provider's or the replay's), in a
term's added advantages, in a response weighting or in a rule's token weights is a named error before the step, naming
the part, the reward and the sample, and the parameters are as they were; q below -1e-6 is refused, q in [-1e-6, 0)
reads as 0."""

from dataclasses import replace

import pytest
import torch

from tests.helpers import RecordingTrainer, make_args
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.checks.guard import NonFiniteCredit
from trl_mrtpo.credit import replayed_token_weights
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.relevance import Relevance, ReplayRelevance
from trl_mrtpo.rules import Contribution, CreditRule, CreditTerm, register_credit_rule, unregister_credit_rule


class SpoiltQ:
    """A relevance provider: q is 1 on the first two model tokens of each replayed pair, and ``value`` where
    ``where(relevance)`` says (on the first replayed pair's first token by default)."""

    def __init__(self, value: float, everywhere: bool = False):
        self.value, self.everywhere = value, everywhere

    def __call__(self, policy, record):
        replayed = record.varying.clone()
        relevance = torch.zeros((*replayed.shape, record.mask.shape[1]))
        relevance[..., :2] = 1.0
        if self.everywhere:
            relevance[:] = self.value
        elif replayed.any():
            b, k = replayed.nonzero()[0].tolist()
            relevance[b, k, 0] = self.value
        relevance = relevance * record.mask[:, None, :] * replayed[..., None]
        return Relevance(relevance, replayed, bool(replayed.any()))


def trainer_for(tiny_model, tiny_tokenizer, tmp_path, **kwargs):
    overrides = kwargs.pop("args", {})
    return RecordingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=kwargs.pop("info_blocks", BASIC.info_blocks),
        args=make_args(
            tmp_path, **{"max_steps": 1, "per_device_train_batch_size": 8, "num_generations": 4} | overrides
        ),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
        **kwargs,
    )


def refused(trainer, match: str, error_type=NonFiniteCredit) -> str:
    """Trains, expects the named error, and checks that no parameter moved."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(error_type, match=match) as error:
        trainer.train()
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
    return str(error.value)


@pytest.mark.parametrize("everywhere", [False, True], ids=["one-token", "all-nan"])
def test_nan_q_from_a_provider_is_refused_naming_it_the_reward_and_the_sample(
    tiny_model, tiny_tokenizer, tmp_path, everywhere
):
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, relevance_provider=SpoiltQ(float("nan"), everywhere))
    message = refused(trainer, r"non-finite q \(NaN or inf\) from the relevance provider 'SpoiltQ', for reward '")
    assert "first at sample" in message and "Check what the relevance provider 'SpoiltQ' returns" in message


def test_inf_q_from_a_provider_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, relevance_provider=SpoiltQ(float("inf")))
    refused(trainer, "non-finite q")


def test_q_below_zero_is_refused_and_rounding_below_zero_reads_as_zero(tiny_model, tiny_tokenizer, tmp_path):
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path / "negative", relevance_provider=SpoiltQ(-1e-3))
    refused(trainer, r"q below -1e-06 from the relevance provider 'SpoiltQ'")
    advantages = []
    for value in (-5e-7, 0.0):
        torch.manual_seed(0)
        trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path / str(value), relevance_provider=SpoiltQ(value))
        trainer.train()
        assert trainer.credits[0].replayed.any()
        advantages.append(trainer.credits[0].advantages)
    torch.testing.assert_close(advantages[0], advantages[1], atol=0, rtol=0)


class NanLogitsReplay(ReplayRelevance):
    """The built-in replay of a policy whose logits overflow: the lm_head gives NaN while it replays."""

    def __call__(self, policy, record):
        head = policy.get_output_embeddings()
        original = head.weight.data.clone()
        head.weight.data[0, 0] = float("nan")
        try:
            return super().__call__(policy, record)
        finally:
            head.weight.data.copy_(original)


def test_nan_logits_in_the_replay_are_refused_naming_the_replay(tiny_model, tiny_tokenizer, tmp_path):
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, relevance_provider=NanLogitsReplay())
    message = refused(trainer, r"non-finite q \(NaN or inf\) from the replay, for reward")
    assert "logits are not finite" in message


class NanTerm(CreditTerm):
    """A term whose added advantages (``add``) or response weighting (``weigh``) holds a NaN."""

    name = "nan_term"

    def __init__(self, where: str):
        self.where = where

    def weigh(self, rewards, advantages, reward_weights, num_generations, training):
        if self.where == "weigh":
            reward_weights = reward_weights.clone()
            reward_weights[1] = float("nan")
        return advantages, reward_weights

    def __call__(self, batch, tokenizer, num_generations, rank, trainer_state=None):
        process = None
        if self.where == "add":
            process = torch.zeros(batch.mask.shape)
            process[2, 0] = float("nan")
        return Contribution(process=process)

    def relevance(self, relevance, replayed, batch):
        if self.where == "relevance":  # 1e39 is past float32's range: inf
            relevance = torch.where(replayed[..., None] & batch.mask[:, None, :].bool(), relevance + 1e39, relevance)
        return relevance

    def finish(self, credit, inputs):
        if self.where == "finish":
            advantages = credit.advantages.clone()
            advantages[3, 0] = float("nan")
            return replace(credit, advantages=advantages)
        return credit


@pytest.mark.parametrize(
    "where, match",
    [
        ("add", r"non-finite added token advantages from the term 'nan_term', for 1 sample; first at sample 2 "),
        ("weigh", r"non-finite per-reward advantages or reward weights from the term 'nan_term', for reward '"),
        ("relevance", r"non-finite q \(NaN or inf\) returned by relevance\(\) of the term 'nan_term', for reward '"),
        (
            "finish",
            r"non-finite token advantages returned by finish\(\) of the term 'nan_term', for 1 sample; first "
            r"at sample 3 ",
        ),
    ],
)
def test_a_terms_nan_is_refused_naming_the_term(tiny_model, tiny_tokenizer, tmp_path, where, match):
    refused(trainer_for(tiny_model, tiny_tokenizer, tmp_path, credit_terms=[NanTerm(where)]), match)


class NanWeights(CreditRule):
    """Step 5 with a NaN weight on one token of the last sample's first reward."""

    removal = "each"
    reads = ("relevance",)

    def weights(self, inputs):
        weights = replayed_token_weights(inputs.relevance, inputs.replayed, inputs.batch.mask, inputs.betas)
        weights[-1, 0, 0] = float("nan")
        return weights


def test_a_rules_nan_weights_are_refused_naming_the_rule(tiny_model, tiny_tokenizer, tmp_path):
    register_credit_rule("nan_weights", NanWeights)
    try:
        trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, args={"credit_assignment": "nan_weights"})
        message = refused(trainer, r"non-finite token weights from the credit rule 'nan_weights', for reward '")
        assert "first at sample 7 " in message
    finally:
        unregister_credit_rule("nan_weights")


class NanRelevance(NanWeights):
    """A rule whose own relevance() gives NaN: named as the rule's, with no term in the run."""

    def weights(self, inputs):
        return replayed_token_weights(inputs.relevance, inputs.replayed, inputs.batch.mask, inputs.betas)

    def relevance(self, relevance, replayed, batch):
        return relevance * float("nan")


def test_a_rules_own_nan_q_is_named_as_the_rules(tiny_model, tiny_tokenizer, tmp_path):
    register_credit_rule("nan_relevance", NanRelevance)
    try:
        trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, args={"credit_assignment": "nan_relevance"})
        message = refused(trainer, r"returned by relevance\(\) of the credit rule 'nan_relevance', for reward '")
        assert "Check the rule's relevance()." in message and "term" not in message
    finally:
        unregister_credit_rule("nan_relevance")


def test_finite_credit_trains_as_before(tiny_model, tiny_tokenizer, tmp_path):
    """The check only reads: a finite run trains, and its advantages are finite."""
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=1),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert torch.isfinite(trainer.last_credit.advantages).all()


@pytest.mark.slow
def test_nan_on_one_process_raises_the_same_error_on_every_process(tmp_path, tiny_tokenizer):
    """Two processes (DDP over gloo): q is NaN on process 1 only; both raise the same error in the same batch (the
    flag rides in steps 7-8's sums), and neither waits for the other."""
    import os
    import subprocess
    import sys

    from tests.conftest import build_tiny_model
    from tests.test_ddp import DISTRIBUTED_VARIABLES

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu_ddp.yaml",
        "--main_process_port", "0", "tests/nan_rank_worker.py", str(tmp_path), str(model_dir),
    ]  # fmt: skip
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stderr[-6000:]
    messages = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    assert messages[0] == messages[1], messages
    assert "non-finite q (NaN or inf) from the relevance provider 'nan_on_process_one'" in messages[0]
    assert "first at sample 3 of process 1" in messages[0], messages[0]


# ---------------------------------------------------------------- the credit mask, and when a provider is called
class OffMaskQ:
    """Reward k's q is 1 on model token k of every pair (profiles that differ by reward), plus ``spill`` on every
    position off the credit mask (the padding after a shorter completion)."""

    def __init__(self, spill: float):
        self.spill, self.calls = spill, 0

    def __call__(self, policy, record):
        self.calls += 1
        replayed = record.mask.bool().any(-1, keepdim=True).expand_as(record.varying).clone()
        num_rewards, width = replayed.shape[1], record.mask.shape[1]
        mask = record.mask[:, None, :].float()
        own = (torch.arange(width)[None, :] == torch.arange(num_rewards)[:, None]).float()[None]
        relevance = (own * mask + self.spill * (1 - mask)) * replayed[..., None]
        return Relevance(relevance, replayed, bool(replayed.any()))


def test_q_off_the_credit_mask_changes_nothing(tiny_model, tiny_tokenizer, tmp_path):
    """q a provider puts where credit may not land is masked before the weights and before per-reward strength reads
    it: the same betas and advantages with and without it (it moved the betas)."""
    from trl_mrtpo.scripts.inspection import fixed_rollout

    texts = ["hope this helps.", "The sea is blue and wide. Hope this helps.", "blue", "Rain falls on the sea all day"]
    runs = []
    initial = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    for spill in (0.0, 5.0):
        with torch.no_grad():
            for name, p in tiny_model.named_parameters():
                p.copy_(initial[name])
        torch.manual_seed(0)
        args = {"max_steps": 2, "credit_warmup_steps": 0, "reward_strength_floor": 0.25, "max_completion_length": 32}
        trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path / str(spill), relevance_provider=OffMaskQ(spill),
                              rollout_func=fixed_rollout(texts * 4), args=args)  # fmt: skip
        trainer.train()
        runs.append(trainer.credits)
    assert all((credit.mask == 0).any() and (credit.mask == 1).any() for credit in runs[0])
    for clean, spilt in zip(*runs):
        torch.testing.assert_close(spilt.reward_betas, clean.reward_betas, atol=0, rtol=0)
        torch.testing.assert_close(spilt.advantages, clean.advantages, atol=0, rtol=0)


def test_a_provider_is_called_whenever_the_rule_reads_q(tiny_model, tiny_tokenizer, tmp_path):
    """Known relevant tokens need no info block: the provider is called every generation batch and its q moves the
    credit (it was never called without a block, and credit stayed uniform)."""
    provider = OffMaskQ(0.0)
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, relevance_provider=provider, info_blocks=None,
                          args={"max_steps": 2, "credit_warmup_steps": 0})  # fmt: skip
    trainer.train()
    assert provider.calls == 2
    assert any(credit.replayed.any() for credit in trainer.credits)


@pytest.mark.parametrize("mode", ["gdpo", "grpo"])
def test_a_provider_with_a_rule_that_reads_no_q_is_refused_at_start_up(tiny_model, tiny_tokenizer, tmp_path, mode):
    message = rf"the relevance provider 'OffMaskQ' .*credit_assignment='{mode}' reads no q"
    with pytest.raises(ValueError, match=message):
        trainer_for(tiny_model, tiny_tokenizer, tmp_path, relevance_provider=OffMaskQ(0.0),
                    args={"credit_assignment": mode})  # fmt: skip


# ---------------------------------------------------------------- what an extension returns, checked where it enters
class Returns:
    """A relevance provider that returns ``what(record)``."""

    def __init__(self, what):
        self.what = what

    def __call__(self, policy, record):
        return self.what(record)


def q_of(record):
    return torch.zeros((*record.varying.shape, record.mask.shape[1]))


@pytest.mark.parametrize(
    "what, message",
    [
        (lambda r: q_of(r), r"returned a Tensor; it returns a Relevance\(relevance, replayed, any_replayed\)"),
        (lambda r: (q_of(r), r.varying), r"returned a tuple of 2; it returns a Relevance"),
        (lambda r: Relevance(q_of(r)[..., 0], r.varying, True), r"relevance of shape \(8, 4\), expected \(8, 4, 10\)"),
        (lambda r: Relevance(q_of(r), r.varying.float(), True), r"replayed of dtype torch.float32, expected bool"),
        (lambda r: Relevance(q_of(r).long(), r.varying, True), r"relevance of dtype torch.int64, expected float"),
        (lambda r: Relevance(q_of(r), r.varying, torch.tensor(True)), r"any_replayed is a Tensor, expected bool"),
    ],
    ids=["tensor", "pair", "q-shape", "replayed-dtype", "q-dtype", "any-tensor"],
)
def test_a_providers_wrong_output_is_named(tiny_model, tiny_tokenizer, tmp_path, what, message):
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, relevance_provider=Returns(what))
    refused(trainer, r"the relevance provider 'Returns'.*" + message, (TypeError, ValueError))


class BadTerm(CreditTerm):
    """A term whose ``where`` output is wrong."""

    name = "bad_term"

    def __init__(self, where: str):
        self.where = where

    def __call__(self, batch, tokenizer, num_generations, rank, trainer_state=None):
        B, C = batch.mask.shape
        K = batch.varying.shape[1]
        if self.where == "container":
            return {"process": None, "failure_suffix": None}
        if self.where == "process":
            return Contribution(process=torch.zeros(B, C + 1))
        if self.where == "suffix":
            return Contribution(failure_suffix=torch.zeros(B, K, C))
        return Contribution()

    def weigh(self, rewards, advantages, reward_weights, num_generations, training):
        if self.where == "weigh":
            return advantages
        return advantages, reward_weights

    def finish(self, credit, inputs):
        return credit.advantages if self.where == "finish" else credit


@pytest.mark.parametrize(
    "where, message",
    [
        (
            "container",
            r"returned a dict; it returns a Contribution \(trl_mrtpo.rules\)",
        ),
        ("process", r"process of shape \(8, 11\), expected \(8, 10\)"),
        ("suffix", r"failure_suffix of dtype torch.float32, expected bool"),
        ("weigh", r"weigh\(\) returned a Tensor; it returns \(advantages \[N, K\], reward_weights \[K\]\)"),
        ("finish", r"finish\(\) returned a Tensor; it returns a TokenCredit"),
    ],
)
def test_a_terms_wrong_output_is_named(tiny_model, tiny_tokenizer, tmp_path, where, message):
    trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, credit_terms=[BadTerm(where)])
    refused(trainer, r"the term 'bad_term'.*" + message, (TypeError, ValueError))


class FlatWeights(CreditRule):
    """Step 5 returning ``[B, C]`` weights: one profile for every reward."""

    removal = "each"
    reads = ("relevance",)

    def weights(self, inputs):
        return torch.ones_like(inputs.batch.mask, dtype=torch.float32)


def test_a_rules_wrong_weights_are_named(tiny_model, tiny_tokenizer, tmp_path):
    register_credit_rule("flat_weights", FlatWeights)
    try:
        trainer = trainer_for(tiny_model, tiny_tokenizer, tmp_path, args={"credit_assignment": "flat_weights"})
        message = r"the credit rule 'flat_weights': token weights of shape \(8, 10\), expected \(8, 4, 10\)"
        refused(trainer, message, (TypeError, ValueError))
    finally:
        unregister_credit_rule("flat_weights")


def test_reads_given_as_a_string_is_refused_naming_the_part():
    """``reads = "relevance"`` (the tuple's comma forgotten) would read as the letters r, e, l, ...: refused where the
    rule is registered and where a term is given, naming it."""
    from trl_mrtpo.rules import terms_by_name

    class OneString(NanWeights):
        reads = "relevance"

    with pytest.raises(TypeError, match=r"credit rule 'one_string': reads must be a tuple of names, such as"):
        register_credit_rule("one_string", OneString)

    class Reading(CreditTerm):
        name = "reading"
        reads = "relevance"

    with pytest.raises(TypeError, match=r"the term 'reading': reads must be a tuple of names, .* got 'relevance'"):
        terms_by_name([Reading()])


def test_a_research_rule_by_its_path_needs_the_research_configuration_as_by_name(tmp_path):
    """``credit_assignment="trl_mrtpo.research.rules.Joint"`` under MRTPOConfig is refused at once, as ``"joint"``
    is, naming the configuration it needs (it failed at step 1 before, naming a quantity)."""
    from trl_mrtpo import MRTPOConfig
    from trl_mrtpo.rules import resolve_credit_rule

    for name in ("joint", "trl_mrtpo.research.rules.Joint"):
        config = MRTPOConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none")
        config.credit_assignment = name
        needs = r"it needs a trl_mrtpo.research.ResearchConfig"
        with pytest.raises(ValueError, match=rf"credit_assignment='{name}' is unknown; .*{needs}"):
            resolve_credit_rule(config)


def test_the_checked_parts_are_the_parts_the_refusal_words():
    """The keys a run checks (loaded by every run) and the refusal's words (loaded when a batch is refused) name the
    same parts in the same order, which decides the part a refusal names first."""
    from trl_mrtpo.checks.credit_messages import credit_parts
    from trl_mrtpo.checks.guard import part_keys

    for terms in ([], ["steps"], ["a", "b"]):
        assert part_keys("mrtpo", terms) == list(credit_parts("the replay", "mrtpo", terms))
