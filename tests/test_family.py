"""The sibling methods: CoRT, SAW and CONCUR weighting, TACO, INTUITOR's self-certainty."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig

from tests.helpers import ResearchRecordingTrainer, token_advantages
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.baselines.self_certainty import SelfCertaintyReward, self_certainty
from trl_mrtpo.credit import group_advantages, weighted_token_advantages
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.research.credit import cort_weights, taco_scale
from trl_mrtpo.research.token_scores import sampled_logprobs
from trl_mrtpo.research.weighting import (
    ConcurTrust,
    concordance_readings,
    concur_advantages,
    concur_project,
    pava,
    saw_weights,
)

from .test_trainer import assert_token_advantages, make_args, train


# ----------------------------------------------------------------------------------------------------------- CoRT
def test_cort_weights_hand_example():
    contrast = torch.tensor([[0.0, 2.0, -2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w = cort_weights(contrast, mask, strength=1.0, sharpness=1.0, offset=0.0)
    s = torch.sigmoid(torch.tensor([0.0, 2.0, -2.0], dtype=torch.float64)) - 0.5
    raw = 1 + s
    torch.testing.assert_close(w[0, :3].double(), raw / raw.mean(), atol=1e-6, rtol=0)
    assert w[0, 3] == 1.0  # padding
    assert w[0, 1] > w[0, 0] > w[0, 2]  # more criterion-dependent tokens get more credit


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(0.0, 1.99), st.floats(0.1, 5.0), st.floats(-2.0, 2.0))
def test_cort_weights_invariants(seed, strength, sharpness, offset):
    gen = torch.Generator().manual_seed(seed)
    contrast = torch.randn(5, 9, generator=gen) * 3
    mask = (torch.rand(5, 9, generator=gen) < 0.8).int()
    mask[:, 0] = 1
    w = cort_weights(contrast, mask, strength, sharpness, offset)
    means = (w * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(means, torch.ones(5), atol=1e-5, rtol=0)
    # before normalisation weights lie in [1 - strength/2, 1 + strength/2]: within a response their ratio is bounded
    for row, m in zip(w, mask.bool()):
        real = row[m]
        assert (real > 0).all()
        # relative fp32 tolerance: near strength 2 the smallest weight is a difference of two numbers near 1
        assert real.max() / real.min() <= (1 + strength / 2) / (1 - strength / 2) * (1 + 1e-5)


def test_cort_strength_zero_is_gdpo_and_bad_strength_is_refused():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 2, (8, 3), generator=gen).float()
    adv, varying = group_advantages(rewards, 4)
    mask = torch.ones(8, 6)
    mask[3, 4:] = 0
    weights = cort_weights(torch.randn(8, 6, generator=gen), mask, strength=0.0)[:, None, :].expand(8, 3, 6)
    cort = weighted_token_advantages(adv, weights, mask, torch.ones(3), None)
    gdpo = token_advantages(adv, torch.zeros(8, 3, 6), varying, mask, torch.ones(3), beta=0.0)
    torch.testing.assert_close(cort.advantages, gdpo.advantages)
    with pytest.raises(ValueError, match="CoRT strength"):
        cort_weights(torch.zeros(1, 2), torch.ones(1, 2), strength=2.0)


# ----------------------------------------------------------------------------------------------------------- TACO
def test_taco_scales_only_positive_advantages_smoothly():
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, 0.0]])
    surprisal = torch.tensor([[0.0, 4.0, 12.0, 0.0, 12.0, 12.0]])
    out = taco_scale(adv, surprisal, strength=0.8, threshold=4.0, sharpness=1.0)
    expected_factor = 1 - 0.8 * torch.sigmoid(torch.tensor([-4.0, 0.0, 8.0]))
    torch.testing.assert_close(out[0, :3], expected_factor)
    assert out[0, 1] == pytest.approx(0.6)  # half way at the threshold
    assert (out[0, 3:] == adv[0, 3:]).all()  # negative and zero advantages untouched
    assert (out[0, :3] >= 1 - 0.8).all() and (out[0, :3] <= 1).all()
    torch.testing.assert_close(taco_scale(adv, surprisal, 0.0, 4.0, 1.0), adv)
    with pytest.raises(ValueError, match="TACO strength"):
        taco_scale(adv, surprisal, 1.5, 4.0, 1.0)


# ------------------------------------------------------------------------------------------------------------ SAW
def test_saw_weights_hand_example():
    rewards = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0]])
    cv_a = math.sqrt(1 / 3) / 0.5  # std (Bessel) / mean
    cv_b = 0.5 / 0.75
    w = saw_weights(rewards)
    torch.testing.assert_close(w.double(), torch.tensor([2 * cv_a, 2 * cv_b], dtype=torch.float64) / (cv_a + cv_b))
    assert w.sum().item() == pytest.approx(2.0)


def test_saw_weights_edge_cases():
    assert saw_weights(torch.ones(4, 3)).tolist() == [1.0, 1.0, 1.0]  # nothing varies: static
    nan = float("nan")
    rewards = torch.tensor([[0.0, nan, 1.0], [1.0, nan, 1.0], [0.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    w = saw_weights(rewards)  # NaN ignored; a never-applicable column would weigh 0
    assert torch.isfinite(w).all() and w.sum().item() == pytest.approx(3.0)
    assert saw_weights(torch.tensor([[0.0, 0.0], [0.0, 1.0]]))[0] == 0  # mean 0: no signal


# --------------------------------------------------------------------------------------------------------- CONCUR
def test_pava():
    assert pava(torch.tensor([1.0, 3.0, 2.0, 4.0]), torch.ones(4)).tolist() == [1.0, 2.5, 2.5, 4.0]
    assert pava(torch.tensor([3.0, 1.0]), torch.tensor([3.0, 1.0])).tolist() == [2.5, 2.5]
    assert pava(torch.tensor([1.0, 2.0]), torch.ones(2)).tolist() == [1.0, 2.0]


def test_concur_worked_example_is_already_feasible():
    """Worked example: primary [0.3, 0.3, 0.7] with auxiliary advantages [-1, 0, 1] stays unchanged (the two 0.3
    responses are not averaged: equal primary below the ceiling is unconstrained)."""
    primary = torch.tensor([0.3, 0.3, 0.7])
    auxiliary = torch.tensor([-1.0, 0.0, 1.0])
    assert concur_project(primary, auxiliary, tie_ceiling=True).tolist() == [-1.0, 0.0, 1.0]
    # same in another order of the responses
    assert concur_project(primary[[2, 0, 1]], auxiliary[[2, 0, 1]], True).tolist() == [1.0, -1.0, 0.0]


def test_concur_repairs_violations_and_ties_the_ceiling():
    # higher primary with lower auxiliary: pooled
    assert concur_project(torch.tensor([0.2, 0.8]), torch.tensor([1.0, -1.0]), False).tolist() == [0.0, 0.0]
    primary = torch.tensor([1.0, 1.0, 0.5])
    auxiliary = torch.tensor([1.0, -1.0, 0.0])
    assert concur_project(primary, auxiliary, tie_ceiling=True).tolist() == [0.0, 0.0, 0.0]
    assert concur_project(primary, auxiliary, tie_ceiling=False).tolist() == [1.0, -0.5, -0.5]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=8), st.integers(0, 2**31 - 1), st.booleans())
def test_concur_projection_invariants(primary, seed, tie):
    primary = torch.tensor(primary)
    auxiliary = torch.randn(len(primary), generator=torch.Generator().manual_seed(seed))
    out = concur_project(primary, auxiliary, tie)
    for i in range(len(primary)):
        for j in range(len(primary)):
            if primary[i] > primary[j]:
                assert out[i] >= out[j] - 1e-6
            if tie and primary[i] >= 1.0 and primary[j] >= 1.0:
                assert out[i] == pytest.approx(out[j].item())
    assert out.sum().item() == pytest.approx(auxiliary.sum().item(), abs=1e-5)  # PAVA keeps the total
    torch.testing.assert_close(concur_project(primary, out, tie), out)  # a projection is idempotent


def test_concordance_readings():
    primary = torch.tensor([1.0, 0.8, 0.9, 0.2])
    auxiliary = torch.tensor([0.9, 0.1, 0.1, 1.0])
    # passing at 0.5: responses 0, 1, 2; pairs (0,1) agree, (0,2) agree, (1,2) aux tie -> no reading
    assert concordance_readings(primary, auxiliary, 0.5) == [1.0, 1.0]
    assert concordance_readings(torch.tensor([0.9, 0.8]), torch.tensor([0.0, 1.0]), 0.5) == [-1.0]


def test_concur_trust_uses_the_whole_batch_before_projecting():
    """60 concordant readings in history, the 61st comes from the batch's second group; the first group
    must already use the merged state (the ceiling tie is released for it too)."""
    nan = float("nan")
    # two groups of 3; reward 0 primary, reward 1 auxiliary
    rewards = torch.tensor(
        [[1.0, 0.9], [1.0, 0.1], [0.0, 0.5], [1.0, 0.9], [0.8, 0.2], [0.0, nan]]  # group 2: one reading
    )
    adv, _ = group_advantages(rewards, 3)
    released = {1: ConcurTrust(count=60, total=60.0, total_squares=60.0)}
    out = concur_advantages(rewards, adv, 3, 0, 0.5, 1.0, "adaptive", released)
    assert released[1].count == 61 and not released[1].tie_ceiling()
    assert out[0, 1] != out[1, 1]  # group 1's ceiling responses keep distinct auxiliary advantages
    bound = {1: ConcurTrust(count=59, total=59.0, total_squares=59.0)}
    out = concur_advantages(rewards, adv, 3, 0, 0.5, 1.0, "adaptive", bound)
    assert bound[1].tie_ceiling() and out[0, 1] == out[1, 1]
    torch.testing.assert_close(out[:, 0], adv[:, 0])  # the primary is untouched
    # failing responses are gated: response 2 (primary 0) has auxiliary 0.5 but counts as 0, the group minimum
    assert out[2, 1] <= out[0, 1] and out[2, 1] <= out[1, 1]


def test_concur_trust_rebinds_when_readings_turn():
    state = ConcurTrust(min_readings=4)
    state.update([1.0] * 6)
    assert not state.tie_ceiling()
    state.update([-1.0] * 6)
    assert state.tie_ceiling()


# ---------------------------------------------------------------------------------------------------- token scores
def test_sampled_logprobs_and_self_certainty_against_float64():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(11, 16, generator=gen)
    weight = torch.randn(70, 16, generator=gen)
    bias = torch.randn(70, generator=gen)
    tokens = torch.randint(0, 70, (11,), generator=gen)
    logprobs = torch.log_softmax((hidden.double() @ weight.double().T + bias.double()) / 0.7, -1)
    got = sampled_logprobs(hidden, tokens, weight, bias, 0.7, vocab_chunk_size=4)
    torch.testing.assert_close(got.double(), logprobs.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    kl_uniform = (torch.full_like(logprobs, -math.log(70)) - logprobs).mean(-1)  # sum_v (1/V) log((1/V) / p_v)
    torch.testing.assert_close(
        self_certainty(hidden, weight, bias, 0.7, vocab_chunk_size=3).double(), kl_uniform, atol=1e-5, rtol=0
    )
    assert (self_certainty(hidden, weight, bias) >= 0).all()
    flat = self_certainty(torch.zeros(2, 16), weight, None)  # uniform distribution: no certainty
    torch.testing.assert_close(flat, torch.zeros(2), atol=1e-6, rtol=0)
    # a bf16 lm_head is read tile by tile (no fp32 copy of it): the float64 values of its rounded weights
    rounded = weight.bfloat16()
    logprobs = torch.log_softmax((hidden.double() @ rounded.double().T + bias.double()) / 0.7, -1)
    got = sampled_logprobs(hidden, tokens, rounded, bias, 0.7, vocab_chunk_size=4)
    torch.testing.assert_close(got.double(), logprobs.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    kl_uniform = (torch.full_like(logprobs, -math.log(70)) - logprobs).mean(-1)
    got = self_certainty(hidden, rounded, bias, 0.7, vocab_chunk_size=3)
    torch.testing.assert_close(got.double(), kl_uniform, atol=1e-5, rtol=0)


def test_self_certainty_reward_needs_a_trainer():
    with pytest.raises(RuntimeError, match="bind"):
        SelfCertaintyReward()(["hi"], ["there"], [[1, 2]])


# ------------------------------------------------------------------------------------------------ training, 2 steps
def test_cort_trains_and_matches_plain_forwards(tiny_model, tiny_tokenizer, tmp_path):
    """Two steps with LoRA; the contrast of one response recomputed from two full-logits forwards."""

    class CheckingTrainer(ResearchRecordingTrainer):
        def _cort_contrast(self, batch):
            contrast, replayed = super()._cort_contrast(batch)
            _, context_ids, completion_ids = self._replay_inputs(batch, joint=True)
            i = next(i for i, c in enumerate(context_ids) if len(c) == 2)
            completion = completion_ids[i]
            self.model.eval()
            with torch.no_grad():
                by_hand = []
                for ids in context_ids[i]:
                    logits = self.model(input_ids=torch.tensor([list(ids) + completion])).logits[0].double()
                    logits = logits[len(ids) - 1 : len(ids) - 1 + len(completion)] / self.temperature
                    by_hand.append(logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0])
            self.model.train()
            self.checked = (contrast[i, : len(completion)].double(), by_hand[0] - by_hand[1])
            self.cort_replayed = replayed
            return contrast, replayed

    trainer = CheckingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, credit_assignment="cort", temperature=0.8, cort_eta=1.5),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    got, expected = trainer.checked
    assert expected.abs().max() > 1e-4
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert_token_advantages(trainer)
    # CoRT keeps each response's total credit: mean token advantage / U_j is one batch-wide factor
    credit = trainer.credits[0]  # the first batch has varying rewards (the second may not)
    uniform = (credit.group_advantages * trainer.reward_weights).sum(-1)
    ratios = [
        credit.advantages[j][credit.mask[j].bool()].mean() / uniform[j]
        for j in range(len(uniform))
        if uniform[j].abs() > 1e-3
    ]
    assert len(ratios) > 1
    torch.testing.assert_close(torch.stack(ratios), ratios[0].expand(len(ratios)), rtol=1e-4, atol=0)
    assert trainer.cort_replayed.any()
    logged = [key for entry in trainer.state.log_history for key in entry]
    assert "mrtpo/replayed_fraction" in logged and not any(key.startswith("mrtpo/q_mean") for key in logged)
    advantages = trainer.batches[0]["advantages"]
    mask = trainer.batches[0]["completion_mask"].bool()
    assert any(row[m].unique().numel() > 1 for row, m in zip(advantages, mask))  # not uniform any more


@pytest.mark.parametrize(
    "overrides",
    [
        {"reward_weighting": "saw"},
        {"reward_weighting": "concur", "concur_primary": "end_phrase_reward"},
        {"reward_weighting": "concur", "concur_ceiling_mode": "tie", "credit_assignment": "gdpo"},
        {"taco_strength": 0.7, "taco_threshold": 3.0},
        {"taco_strength": 0.7, "credit_assignment": "cort", "reward_weighting": "saw"},
    ],
)
def test_weighting_and_taco_train_two_steps(tiny_model, tiny_tokenizer, tmp_path, overrides):
    trainer = train(tiny_model, tiny_tokenizer, tmp_path, **overrides)
    assert trainer.state.global_step == 2
    assert_token_advantages(trainer)


def test_taco_leaves_negative_advantages_of_the_same_batch_untouched(tiny_model, tiny_tokenizer, tmp_path):
    """With the same seed, TACO on and off sample the same first batch: negative advantages are identical, positive
    ones shrink (never grow, never flip sign)."""
    plain = train(tiny_model, tiny_tokenizer, tmp_path / "a", max_steps=1, credit_assignment="gdpo")
    taco = train(tiny_model, tiny_tokenizer, tmp_path / "b", max_steps=1, credit_assignment="gdpo", taco_strength=1.0)
    before, after = plain.batches[0]["advantages"], taco.batches[0]["advantages"]
    assert torch.equal(plain.batches[0]["completion_ids"], taco.batches[0]["completion_ids"])
    assert torch.equal(after[before <= 0], before[before <= 0])
    assert (after[before > 0] <= before[before > 0]).all() and (after[before > 0] > 0).all()
    assert (after[before > 0] < before[before > 0]).any()


def test_self_certainty_reward_trains(tiny_model, tiny_tokenizer, tmp_path):
    reward = SelfCertaintyReward()
    trainer = train(
        tiny_model, tiny_tokenizer, tmp_path, rewards=[*BASIC.rewards, reward], blocks=[*BASIC.info_blocks, None]
    )
    assert reward._trainer is trainer
    values = [
        h["rewards/self_certainty/mean"] for h in trainer.state.log_history if "rewards/self_certainty/mean" in h
    ]
    assert len(values) == 2 and all(v > 0 for v in values)


def test_concur_primary_must_be_a_reward(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="concur_primary='nope'"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path, reward_weighting="concur", concur_primary="nope"),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )


# ---------------------------------------------------------------- edge cases that mutation testing found unguarded
def test_cort_defaults_offset_and_one_token_responses():
    contrast = torch.tensor([[2.0, -1.0, 0.5], [3.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    torch.testing.assert_close(cort_weights(contrast, mask, 1.0), cort_weights(contrast, mask, 1.0, 1.0, 0.0))
    raw = 1.0 + 1.5 * (torch.sigmoid(2.0 * (contrast[0] - 0.7)) - 0.5)  # by hand, offset 0.7, sharpness 2
    torch.testing.assert_close(cort_weights(contrast, mask, 1.5, 2.0, 0.7)[0], raw / raw.mean())
    assert cort_weights(contrast, mask, 1.5)[1].tolist() == [1.0, 1.0, 1.0]  # one token: its weight is exactly 1


def _trust_reference(readings: list[float]) -> bool:
    """CONCUR-A's rule in float64 with the statistics module: tie unless mean > 2 standard errors."""
    import statistics

    mean = statistics.fmean(readings)
    return not mean > 2.0 * statistics.stdev(readings) / math.sqrt(len(readings))


@pytest.mark.parametrize("batches", [1, 3])
def test_concur_trust_rule_matches_a_reference(batches):
    for concordant in range(30, 62):
        readings = [1.0] * concordant + [-1.0] * (61 - concordant) + [1.0, -1.0] * (concordant % 3)
        state = ConcurTrust()
        for part in range(batches):  # the state accumulates over update calls
            state.update(readings[part::batches])
        assert state.count == len(readings) and state.total_squares == len(readings)
        assert state.tie_ceiling() == _trust_reference(readings), concordant
    too_few = ConcurTrust(min_readings=61)
    too_few.update([1.0] * 60)
    assert too_few.tie_ceiling()  # 60 perfectly concordant readings are not enough


def test_concur_gates_at_the_threshold_inclusive_and_modes_differ():
    # primary exactly at the pass threshold passes (and counts for readings)
    assert concordance_readings(torch.tensor([1.0, 0.5]), torch.tensor([2.0, 1.0]), pass_threshold=0.5) == [1.0]
    # one group of 4: primary [1, 1, 0.5, nan]; auxiliary [3, 1, 2, 5]; threshold 1 and ceiling 1
    rewards = torch.tensor([[1.0, 3.0], [1.0, 1.0], [0.5, 2.0], [float("nan"), 5.0]])
    advantages, _ = group_advantages(rewards, 4)
    tie = concur_advantages(rewards, advantages, 4, 0, 1.0, 1.0, "tie")
    free = concur_advantages(rewards, advantages, 4, 0, 1.0, 1.0, "none")
    torch.testing.assert_close(tie[:, 0], advantages[:, 0])  # the primary is untouched
    # failing responses (0.5, and NaN read as 0) are gated to 0, then standardised with the passing ones
    gated, _ = group_advantages(torch.tensor([[3.0], [1.0], [0.0], [0.0]]), 4)
    torch.testing.assert_close(free[:, 1], gated[:, 0])  # already in the primary's order: unchanged
    assert tie[0, 1] == tie[1, 1] == gated[:2, 0].mean()  # tied at the ceiling: one shared advantage
    assert free[0, 1] != free[1, 1]
    with pytest.raises(ValueError, match="ceiling_mode must be 'tie', 'adaptive' or 'none', got 'both'"):
        concur_advantages(rewards, advantages, 4, 0, 1.0, 1.0, "both")
    with pytest.raises(ValueError, match="ceiling_mode='adaptive' needs a trust state"):
        concur_advantages(rewards, advantages, 4, 0, 1.0, 1.0, "adaptive")
    trust = {}
    concur_advantages(rewards, advantages, 4, 0, 1.0, 1.0, "adaptive", trust)
    assert trust[1].min_readings == 61  # the default


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_concur_projection_keeps_the_dtype(dtype):
    assert pava(torch.tensor([2.0, 1.0], dtype=dtype), torch.ones(2, dtype=dtype)).dtype == dtype
    out = concur_project(torch.tensor([0.2, 0.5]), torch.tensor([1.0, -1.0], dtype=dtype), True, 1.0)
    assert out.dtype == dtype and out.tolist() == [0.0, 0.0]
