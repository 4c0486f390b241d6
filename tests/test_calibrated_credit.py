"""Calibrated credit (docs/method.md, "Calibrated credit"): null correction and preserved totals, against float64
loop references, hand-worked examples and invariants; the trainer's wiring. Per-reward strength, which became the
default, is tested in tests/test_strength.py."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_args, recording_trainer, token_advantages, token_advantages_preserving_totals
from trl_mrtpo.credit import group_advantages, token_weights
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.research.credit import null_corrected_relevance, preserved_token_advantages


def reference_preserved(adv, weights, mask, c, rho):
    """Preserved totals in float64 loops, from docs/method.md: per-reward cap, rescale by the uniform std."""
    n, k_count = adv.shape
    lengths = [int(m.sum()) for m in mask]
    adv, weights, c = adv.double(), weights.double(), c.double()
    factors = []
    for k in range(k_count):
        uni = sum(lengths[j] * (c[k] * adv[j, k]).item() ** 2 for j in range(n))
        red = sum(
            ((c[k] * adv[j, k]).item() * (weights[j, k, t].item() - 1)) ** 2
            for j in range(n)
            for t in range(lengths[j])
        )
        factors.append(1.0 if red <= 1e-12 * uni else min(1.0, math.sqrt((rho - 1) * uni / red)))
    uniform = [sum((c[k] * adv[j, k]).item() for k in range(k_count)) for j in range(n)]
    flat = [uniform[j] for j in range(n) for _ in range(lengths[j])]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / (len(flat) - 1)) if len(flat) > 1 else 0.0
    out = torch.zeros(mask.shape, dtype=torch.float64)
    for j in range(n):
        for t in range(lengths[j]):
            s = uniform[j] + sum(
                factors[k] * (c[k] * adv[j, k]).item() * (weights[j, k, t].item() - 1) for k in range(k_count)
            )
            out[j, t] = s / std if std > 0 else s
    return out, factors, std


@st.composite
def batches(draw):
    groups, G, K, C = (
        draw(st.integers(1, 3)),
        draw(st.integers(2, 4)),
        draw(st.integers(1, 4)),
        draw(st.integers(1, 6)),
    )
    n = groups * G
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    rewards = torch.randint(0, 3, (n, K), generator=gen).float() / draw(st.sampled_from([1.0, 3.0]))
    lengths = torch.randint(1, C + 1, (n,), generator=gen)
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    q = torch.rand(n, K, C, generator=gen) * (torch.rand(n, K, 1, generator=gen) < 0.8)
    c = torch.rand(K, generator=gen) * 2
    return rewards, q, mask, c, draw(st.floats(0.0, 1.0)), draw(st.floats(1.0, 4.0)), G


@settings(max_examples=100, deadline=None)
@given(batches())
def test_preserved_totals_match_float64_reference(drawn):
    rewards, q, mask, c, beta, rho, G = drawn
    adv, varying = group_advantages(rewards, G)
    weights = torch.where(varying[..., None], token_weights(q, mask[:, None], beta), torch.ones_like(q))
    credit = preserved_token_advantages(adv, weights, mask, c, rho)
    expected, factors, _ = reference_preserved(adv, weights, mask, c, rho)
    torch.testing.assert_close(credit.advantages.double(), expected, rtol=1e-4, atol=1e-4)
    assert credit.cap_factor == pytest.approx(min(factors), rel=1e-4, abs=1e-6)
    assert (credit.advantages[mask == 0] == 0).all()


@settings(max_examples=100, deadline=None)
@given(batches())
def test_preserved_totals_give_every_response_its_gdpo_total(drawn):
    """The invariant: each response's token advantages sum to GDPO's (beta 0), whatever q, beta and rho."""
    rewards, q, mask, c, beta, rho, G = drawn
    adv, varying = group_advantages(rewards, G)
    preserved = token_advantages_preserving_totals(adv, q, varying, mask, c, beta, rho)
    gdpo = token_advantages(adv, q, varying, mask, c, 0.0, rho)
    torch.testing.assert_close(preserved.advantages.sum(-1), gdpo.advantages.sum(-1), rtol=1e-4, atol=1e-4)
    if beta == 0:  # and at beta 0 it is GDPO token for token
        torch.testing.assert_close(preserved.advantages, gdpo.advantages)


def test_preserved_totals_hold_per_reward_and_the_per_reward_cap_binds():
    """Two rewards on one group of 2; reward 0's q is sharp (its cap binds at rho 1.25), reward 1's is flat."""
    adv = torch.tensor([[1.0, 0.5], [-1.0, -0.5]])
    mask = torch.ones(2, 4, dtype=torch.long)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0], [0.3, 0.3, 0.2, 0.2]], [[0.0, 0.0, 0.0, 1.0], [0.2, 0.2, 0.3, 0.3]]])
    c = torch.ones(2)
    weights = token_weights(q, mask[:, None], 1.0)
    credit = preserved_token_advantages(adv, weights, mask, c, 1.25)
    expected, factors, std = reference_preserved(adv, weights, mask, c, 1.25)
    assert factors[0] < 1 and factors[1] == 1.0  # only the sharp reward is capped, on its own
    torch.testing.assert_close(credit.advantages.double(), expected, rtol=1e-6, atol=1e-6)
    # per reward: the token sum of reward k's part is T c_k A_k / std_B(U) (its GDPO total)
    for k in range(2):
        part = (adv[:, k, None] * (1 + factors[k] * (weights[:, k] - 1))).double() / std
        torch.testing.assert_close(part.sum(-1), 4 * adv[:, k].double() / std)
    # with the shared cap of steps 7-8, the flat reward's share is scaled down together with the sharp one's
    shared = token_advantages(adv, q, torch.ones(2, 2, dtype=torch.bool), mask, c, 1.0, 1.25)
    assert shared.advantages.abs().sum() < credit.advantages.abs().sum()


def test_null_correction_by_hand():
    q = torch.tensor([[[0.5, 0.1, 0.2], [0.1, 0.1, 0.4], [0.3, 0.0, 0.9]]])
    replayed = torch.tensor([[True, True, False]])
    out = null_corrected_relevance(q, replayed)
    torch.testing.assert_close(out[0, 0], torch.tensor([0.4, 0.0, 0.0]))  # minus reward 1's profile
    torch.testing.assert_close(out[0, 1], torch.tensor([0.0, 0.0, 0.2]))  # minus reward 0's profile
    torch.testing.assert_close(out[0, 2], q[0, 2])  # not replayed: untouched
    alone = null_corrected_relevance(q, torch.tensor([[True, False, False]]))
    torch.testing.assert_close(alone, q)  # no control in the response: unchanged


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_null_correction_matches_float64_loops(n, k_count, c_len, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(n, k_count, c_len, generator=gen)
    replayed = torch.rand(n, k_count, generator=gen) < 0.7
    out = null_corrected_relevance(q, replayed)
    for j in range(n):
        for k in range(k_count):
            others = [i for i in range(k_count) if i != k and replayed[j, i]]
            for t in range(c_len):
                value = q[j, k, t].item()
                if replayed[j, k] and others:
                    value = max(0.0, value - min(q[j, i, t].item() for i in others))
                assert out[j, k, t].item() == pytest.approx(value, abs=1e-7)
    assert (out >= 0).all() and (out <= q).all()


def test_identical_profiles_are_all_background():
    q = torch.rand(2, 3, 5)
    same = q[:, :1].expand(2, 3, 5).clone()
    assert (null_corrected_relevance(same, torch.ones(2, 3, dtype=torch.bool)) == 0).all()


@pytest.mark.parametrize("option", ["relevance_null_correction", "preserve_reward_totals"])
def test_trainer_runs_each_option(tiny_model, tiny_tokenizer, tmp_path, option):
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, **{option: True}),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    for generated in trainer.batches:
        assert torch.isfinite(generated["advantages"]).all()
        assert (generated["advantages"][generated["completion_mask"] == 0] == 0).all()
    assert trainer.replays and any(r["replayed"].any() for r in trainer.replays)


@pytest.mark.parametrize("mode", ["joint", "cort", "gdpo"])
def test_null_correction_needs_per_reward_q(tmp_path, mode):
    with pytest.raises(ValueError, match="relevance_null_correction.*credit_assignment"):
        make_args(tmp_path, credit_assignment=mode, relevance_null_correction=True)
