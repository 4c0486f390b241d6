"""The advantages MRTPOTrainer hands to the loss, recomputed from what it recorded with an independent float64
reference (tests/test_credit.py's loops, not the functions under test), for every mode and weighting.

Each test trains a real step on a tiny random Llama with the demo task and replays every pair, so the recorded
q profiles are real; the reference then rebuilds group normalisation, response weighting, token weights, the cap
and the batch rescale from the rewards and q alone.
"""

import math

import pytest
import torch

from tests.helpers import ResearchRecordingTrainer, graded_length, graded_length_too, make_args
from tests.reference import reference_saw, reference_strength_betas, reference_token_advantages
from trl_mrtpo.credit import warmup_beta
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset


def run(
    tiny_model,
    tiny_tokenizer,
    tmp_path,
    rewards=BASIC.rewards,
    blocks=BASIC.info_blocks,
    trainer_class=ResearchRecordingTrainer,
    **overrides,
):
    values = dict(max_steps=2, per_device_train_batch_size=8, num_generations=4, replay_only_varying=True)
    values.update(overrides)
    trainer = trainer_class(
        model=tiny_model,
        reward_funcs=rewards,
        info_blocks=blocks,
        args=make_args(tmp_path, research=True, **values),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert len(trainer.credits) == values["max_steps"]
    return trainer


@pytest.mark.parametrize("weighting", ["static", "saw"])
@pytest.mark.parametrize("mode", ["mrtpo", "gdpo", "joint", "shuffled"])
def test_token_advantages_match_float64_reference(tiny_model, tiny_tokenizer, tmp_path, mode, weighting):
    # a fractional reward that always varies, beside the demo's: at least two rewards carry signal, so their
    # relative weights (SAW) show in the token advantages
    trainer = run(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[graded_length, *BASIC.rewards],
        blocks=[lambda **_: "Be long.", *BASIC.info_blocks],
        credit_assignment=mode,
        reward_weighting=weighting,
        # per-reward strength: the tiny model's q profiles differ from each other by 1 - cos ~ 0.004-0.006, so this
        # floor gives strengths strictly between 0 and 1
        **({"reward_strength_floor": 0.003} if mode in ("mrtpo", "shuffled") else {}),
    )
    # mrtpo: each step's betas from the float64 reference of its readings; shuffled reads before permuting (the
    # record holds the permuted q), so its recorded betas are used as given
    if mode == "mrtpo":
        readings = [(credit.relevance, credit.replayed) for credit in trainer.credits]
        strength = reference_strength_betas(readings, [0.5, 0.5], 0.003, num_rewards=len(trainer.reward_funcs))
        for credit, betas in zip(trainer.credits, strength):
            torch.testing.assert_close(credit.reward_betas.double(), torch.tensor(betas).double(), atol=1e-6, rtol=0)
            assert any(0 < b < 0.5 for b in betas)  # the per-reward path, not all-or-nothing
    for credit in trainer.credits:
        expected_beta = 0.0 if mode == "gdpo" else 0.5
        assert credit.beta == expected_beta
        if mode in ("gdpo", "joint"):  # no per-reward q to read: one beta for every reward
            assert torch.all(credit.reward_betas == expected_beta)
        c = trainer.reward_weights.double()
        if weighting == "saw":
            c = c * reference_saw(credit.rewards.double())
        expected, _ = reference_token_advantages(
            credit.rewards.double(), credit.relevance.double(), credit.mask, c, credit.reward_betas, 2.0, G=4
        )
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)
        if mode != "gdpo":
            assert credit.replayed.any()
            # beta > 0 and a q that varies: tokens of a replayed response are not uniform
            rows = credit.replayed.any(1).nonzero().flatten().tolist()
            spread = [credit.advantages[j, : int(credit.mask[j].sum())].std().item() for j in rows]
            assert max(spread) > 1e-4
        if mode == "joint":  # one replay with every block removed: the same profile for each replayed reward
            for j, k_row in enumerate(credit.replayed):
                ks = k_row.nonzero().flatten().tolist()
                for k in ks[1:]:
                    assert torch.equal(credit.relevance[j, k], credit.relevance[j, ks[0]])


def test_shuffled_q_is_a_permutation_of_mrtpo_q(tiny_tokenizer, tmp_path):
    from tests.conftest import build_tiny_model

    plain = run(build_tiny_model(tiny_tokenizer), tiny_tokenizer, tmp_path / "a", credit_assignment="mrtpo")
    shuffled = run(build_tiny_model(tiny_tokenizer), tiny_tokenizer, tmp_path / "b", credit_assignment="shuffled")
    # same weights and seed: the first generation samples the same completions and replays the same pairs
    first, second = plain.credits[0], shuffled.credits[0]
    assert torch.equal(first.completion_ids, second.completion_ids) and torch.equal(first.replayed, second.replayed)
    moved = 0
    for j, k in first.replayed.nonzero().tolist():
        length = int(first.mask[j].sum())
        a, b = first.relevance[j, k, :length], second.relevance[j, k, :length]
        assert torch.equal(a.sort().values, b.sort().values)
        moved += int(not torch.equal(a, b))
    assert moved > 0


def test_beta_follows_the_warmup_schedule_in_training(tiny_model, tiny_tokenizer, tmp_path):
    trainer = run(tiny_model, tiny_tokenizer, tmp_path, credit_warmup_steps=3, max_steps=4)
    used = [credit.beta for credit in trainer.credits]
    assert used == pytest.approx([warmup_beta(0.5, step, 3) for step in range(4)])
    assert used[0] == 0.0 and 0 < used[1] < used[2] < used[3] == 0.5
    logged = [h["mrtpo/beta"] for h in trainer.state.log_history if "mrtpo/beta" in h]
    assert logged == pytest.approx(used)


def test_groups_are_the_prompt_groups(tiny_model, tiny_tokenizer, tmp_path):
    """Each group of num_generations rows shares a prompt, and its per-reward advantages are centred."""
    trainer = run(tiny_model, tiny_tokenizer, tmp_path, credit_assignment="gdpo")
    for credit in trainer.credits:
        for g in range(0, len(credit.prompts), 4):
            assert all(p == credit.prompts[g] for p in credit.prompts[g : g + 4])
            torch.testing.assert_close(
                credit.group_advantages[g : g + 4].sum(0), torch.zeros(credit.rewards.shape[1]), atol=1e-5, rtol=0
            )


def test_concur_shapes_the_auxiliary_advantages(tiny_model, tiny_tokenizer, tmp_path):
    """CONCUR (first reward primary, pass threshold 1): a failing response's auxiliary reward is gated to 0 before
    group normalisation, so failing responses of a group share one auxiliary advantage, never above a passing
    one's; the token advantages are then steps 5-8 of the recorded (projected) advantages."""
    from tests.reference import reference_advantages_from

    trainer = run(tiny_model, tiny_tokenizer, tmp_path, reward_weighting="concur", concur_ceiling_mode="tie")
    varied = 0
    for credit in trainer.credits:
        primary = credit.rewards[:, 0]
        for g in range(0, len(primary), 4):
            rows = range(g, g + 4)
            failing = [j for j in rows if primary[j] < 1]
            passing = [j for j in rows if primary[j] >= 1]
            for k in (1, 2):
                values = {round(credit.group_advantages[j, k].item(), 6) for j in failing}
                assert len(values) <= 1
                varied += len({credit.rewards[j, k].item() for j in failing}) > 1  # raw rewards did differ
                if failing and passing:
                    low = credit.group_advantages[failing[0], k]
                    assert all(credit.group_advantages[j, k] >= low - 1e-6 for j in passing)
        expected = reference_advantages_from(
            credit.group_advantages,
            credit.replayed,
            credit.relevance,
            credit.mask,
            trainer.reward_weights,
            credit.reward_betas,
            trainer.args.max_second_moment_ratio,
        )
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)
    assert varied > 0  # the gate had something to remove


class LossInputsTrainer(ResearchRecordingTrainer):
    """Also keeps what `_compute_loss` receives."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.generated, self.loss_inputs = [], []

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        if self.model.training:
            self.generated.append({k: output[k].clone() for k in ("completion_ids", "advantages")})
        return output

    def _compute_loss(self, model, inputs):
        self.loss_inputs.append({k: inputs[k].clone() for k in ("completion_ids", "advantages")})
        return super()._compute_loss(model, inputs)


def test_the_loss_receives_the_advantages_computed_at_generation(tiny_model, tiny_tokenizer, tmp_path):
    """num_iterations=2, steps_per_generation=2, gradient accumulation 2: every row the loss sees is a row of its
    generation batch, advantages unchanged, and each generated row is used num_iterations times."""
    trainer = LossInputsTrainer(
        model=tiny_model,
        reward_funcs=[graded_length, *BASIC.rewards],
        info_blocks=[lambda **_: "Be long.", *BASIC.info_blocks],
        args=make_args(
            tmp_path,
            research=True,
            max_steps=4,
            per_device_train_batch_size=4,
            num_generations=4,
            steps_per_generation=2,
            gradient_accumulation_steps=2,
            num_iterations=2,
        ),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert trainer.generated and trainer.loss_inputs
    generated = [
        (tuple(ids.tolist()), adv)
        for batch in trainer.generated
        for ids, adv in zip(batch["completion_ids"], batch["advantages"])
    ]
    uses = [0] * len(generated)
    for batch in trainer.loss_inputs:
        for ids, adv in zip(batch["completion_ids"], batch["advantages"]):
            width = adv.shape[0]
            matches = [
                i
                for i, (g_ids, g_adv) in enumerate(generated)
                if g_ids[:width] == tuple(ids.tolist()) and torch.equal(g_adv[:width], adv)
            ]
            assert matches, "a loss row matches no generated row"
            uses[matches[0]] += 1
    assert sum(uses) == 2 * len(generated)  # num_iterations = 2: every generated row, twice


def test_eval_uses_its_own_group_size_and_leaves_concur_trust_alone(tiny_model, tiny_tokenizer, tmp_path):
    import copy

    trainer = ResearchRecordingTrainer(
        model=tiny_model,
        reward_funcs=[graded_length, graded_length_too, *BASIC.rewards[:3]],
        info_blocks=[None, lambda **_: "Be long.", *BASIC.info_blocks[:3]],
        args=make_args(
            tmp_path,
            research=True,
            max_steps=2,
            reward_weighting="concur",
            concur_pass_threshold=0.3,
            concur_ceiling=0.5,
            concur_min_readings=2,
            num_generations_eval=2,
            per_device_eval_batch_size=4,
        ),
        train_dataset=make_basic_dataset(8),
        eval_dataset=make_basic_dataset(4, seed=1),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    trust = copy.deepcopy(trainer.credit_terms["reward_weighting"].trust)
    assert trust and sum(state.count for state in trust.values()) > 0
    trainer.credits.clear()
    trainer.evaluate()
    assert trainer.credit_terms["reward_weighting"].trust == trust
    assert trainer.credits
    for credit in trainer.credits:  # groups of num_generations_eval = 2: each pair's advantages are centred
        for g in range(0, len(credit.prompts), 2):
            assert credit.prompts[g] == credit.prompts[g + 1]
            torch.testing.assert_close(
                credit.group_advantages[g : g + 2].sum(0), torch.zeros(credit.rewards.shape[1]), atol=1e-5, rtol=0
            )


def test_cort_advantages_are_gdpo_aggregate_times_its_token_weights(tiny_model, tiny_tokenizer, tmp_path):
    """CoRT: every reward of a response shares one weight profile (mean 1 over the response), applied to GDPO's
    aggregate U and rescaled by the token std, no cap; recomputed here in float64 from the recorded rewards."""
    trainer = run(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[graded_length, *BASIC.rewards],
        blocks=[lambda **_: "Be long.", *BASIC.info_blocks],
        credit_assignment="cort",
        credit_warmup_steps=0,
    )
    for credit in trainer.credits:
        assert credit.beta == 1.0  # CoRT's lambda ramps to 1 (not to credit_beta)
        mask = credit.mask.double()
        weights = credit.weights.double()
        assert torch.allclose(weights, weights[:, :1].expand_as(weights))  # one profile per response
        lengths = mask.sum(-1)
        # mean 1 over each response, to float32 rounding (the weights are normalised in float32)
        torch.testing.assert_close((weights[:, 0] * mask).sum(-1), lengths, atol=1e-5, rtol=1e-6)
        assert (weights[:, 0][mask.bool()] != 1).any()  # and not uniform
        # float64: group advantages by loops, U, S = U * w, token std (Bessel)
        rewards = credit.rewards.double()
        uniform = torch.zeros(len(rewards), dtype=torch.float64)
        for g in range(0, len(rewards), 4):
            for k in range(rewards.shape[1]):
                values = rewards[g : g + 4, k].tolist()
                mean = sum(values) / 4
                std = math.sqrt(sum((v - mean) ** 2 for v in values) / 3)
                if max(values) > min(values):
                    for j in range(4):
                        uniform[g + j] += (values[j] - mean) / (std + 1e-4)
        scores = uniform[:, None] * weights[:, 0] * mask
        tokens = scores[mask.bool()]
        expected = scores / tokens.std()
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)


def test_taco_on_mrtpo_matches_float64_reference(tiny_model, tiny_tokenizer, tmp_path):
    """TACO stacked on MRTPO: the surprisal the trainer computes equals plain forwards, and the advantages handed to
    the loss equal the float64 MRTPO reference with positive token advantages scaled by TACO's factor."""

    class SurprisalTrainer(ResearchRecordingTrainer):
        def _surprisal(self, output):
            surprisal = super()._surprisal(output)
            model, by_hand = self.model, torch.zeros(surprisal.shape, dtype=torch.float64)
            was_training = model.training
            model.eval()
            with torch.no_grad():
                for j, (prompt, keep) in enumerate(zip(output["prompt_ids"], output["prompt_mask"])):
                    length = int(output["completion_mask"][j].sum())
                    prompt = prompt[keep.bool()].tolist()
                    completion = output["completion_ids"][j, :length].tolist()
                    logits = model(torch.tensor([prompt + completion])).logits[0].double() / self.temperature
                    logprobs = logits[len(prompt) - 1 : len(prompt) - 1 + length].log_softmax(-1)
                    by_hand[j, :length] = -logprobs.gather(-1, torch.tensor(completion)[:, None])[:, 0]
            model.train(was_training)
            self.surprisals = [*getattr(self, "surprisals", []), (surprisal, by_hand)]
            return surprisal

    strength, threshold, sharpness = 0.5, 4.0, 1.0
    trainer = run(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[graded_length, *BASIC.rewards],
        blocks=[lambda **_: "Be long.", *BASIC.info_blocks],
        trainer_class=SurprisalTrainer,
        taco_strength=strength,
        taco_threshold=threshold,
        taco_sharpness=sharpness,
    )
    assert len(trainer.credits) == len(trainer.surprisals) == 2
    for credit, (surprisal, by_hand) in zip(trainer.credits, trainer.surprisals):
        torch.testing.assert_close(surprisal.double(), by_hand, atol=2e-5, rtol=0)
        expected, _ = reference_token_advantages(
            credit.rewards.double(), credit.relevance.double(), credit.mask, trainer.reward_weights.double(),
            credit.reward_betas, 2.0, G=4,
        )  # fmt: skip
        factor = 1 - strength / (1 + torch.exp(-sharpness * (by_hand - threshold)))
        expected = torch.where(expected > 0, expected * factor, expected)
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)
        assert (expected > 0).any() and (expected < 0).any()


def test_the_shipped_strength_floor_gives_each_reward_a_beta_inside_the_range(tiny_model, tiny_tokenizer, tmp_path):
    """At the shipped ``reward_strength_floor`` (0.25, MRTPOConfig's default), with q profiles that differ per reward
    as a real policy's do (an oracle provider: the tiny random model's own profiles differ by ~0.005 and would rest
    every reward): every replayed reward's beta lies strictly between 0 and ``credit_beta``, equals the float64
    reference of the readings, and the token advantages equal the float64 reference of steps 1-8 with those betas."""
    from tests.helpers import DistinctProfiles, RecordingTrainer
    from trl_mrtpo import MRTPOConfig

    floor = MRTPOConfig.reward_strength_floor
    assert floor == 0.25
    trainer = RecordingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=3, per_device_train_batch_size=8, reward_strength_floor=floor),
        train_dataset=make_basic_dataset(24),
        processing_class=tiny_tokenizer,
        relevance_provider=DistinctProfiles([b is not None for b in BASIC.info_blocks]),
    )
    trainer.train()
    readings = [(credit.relevance, credit.replayed) for credit in trainer.credits]
    strength = reference_strength_betas(readings, [0.5] * 3, floor, num_rewards=len(trainer.reward_funcs))
    for credit, betas in zip(trainer.credits, strength):
        torch.testing.assert_close(credit.reward_betas.double(), torch.tensor(betas).double(), atol=1e-6, rtol=0)
        replayed = credit.replayed.any(0).tolist()
        assert all(0 < b < 0.5 for b, read in zip(betas, replayed) if read), betas
        expected, _ = reference_token_advantages(
            credit.rewards.double(), credit.relevance.double(), credit.mask, trainer.reward_weights.double(),
            credit.reward_betas, 2.0, G=4,
        )  # fmt: skip
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)
