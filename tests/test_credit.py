"""credit.py against a hand-worked example, a float64 loop reference, TRL's own normalisation, and invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import token_advantages
from tests.reference import reference_token_advantages
from trl_mrtpo.credit import (
    batch_rescale,
    cap_redistribution,
    combine,
    group_advantages,
    short_run_warning,
    token_weights,
    warmup_beta,
    warmup_steps,
)
from trl_mrtpo.research.credit import shuffle_relevance

# ---------------------------------------------------------------- hand-worked example
# One group of G=2, K=2 rewards: r1 = [1, 0] varies, r2 = [0, 0] is constant. Response 0 has 3 tokens with
# q1 = [0.6, 0.2, 0.1] (qbar 0.3); response 1 has 2 tokens. beta = 0.5, c = [1, 1], rho = 2.
#   A1 = +-a with a = 0.5 / (std + 1e-4), std = sqrt(0.5) (Bessel); A2 = 0.
#   w1 of response 0 = 0.5 + 0.5 * q / 0.3 = [1.5, 5/6, 2/3]  (mean 1, floor 0.5).
#   S = a * [1.5, 5/6, 2/3 | -1, -1]; R = a * [0.5, -1/6, -1/3 | 0, 0]; the cap s = min(1, sqrt(5 / (7/18))) = 1.
#   Tokens' mean = 0.2a, Bessel variance = a^2 * (1.3^2 + (19/30)^2 + (7/15)^2 + 2 * 1.2^2) / 4, so the final
#   advantages are S / std and a cancels out.
REWARDS = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
Q = torch.zeros(2, 2, 3)
Q[0, 0] = torch.tensor([0.6, 0.2, 0.1])
HAND_STD = math.sqrt((1.3**2 + (19 / 30) ** 2 + (7 / 15) ** 2 + 2 * 1.2**2) / 4)
HAND_EXPECTED = torch.tensor([[1.5, 5 / 6, 2 / 3], [-1.0, -1.0, 0.0]]) / HAND_STD


def test_hand_worked_example():
    adv, varying = group_advantages(REWARDS, num_generations=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(adv, torch.tensor([[a, 0.0], [-a, 0.0]]))
    assert varying.tolist() == [[True, False], [True, False]]
    w = token_weights(Q[:, 0], MASK, beta=0.5)
    torch.testing.assert_close(w[0], torch.tensor([1.5, 5 / 6, 2 / 3]))
    torch.testing.assert_close(w[1], torch.ones(3))  # qbar = 0: uniform
    credit = token_advantages(adv, Q, varying, MASK, torch.ones(2), beta=0.5, max_second_moment_ratio=2.0)
    assert credit.cap_factor == 1.0
    torch.testing.assert_close(credit.advantages, HAND_EXPECTED)


def test_hand_worked_cap_is_active_for_small_rho():
    # Same example with rho = 1.01: s = sqrt(0.01 * 5 / (7/18)) = sqrt(9/70).
    adv, varying = group_advantages(REWARDS, num_generations=2)
    credit = token_advantages(adv, Q, varying, MASK, torch.ones(2), beta=0.5, max_second_moment_ratio=1.01)
    assert credit.cap_factor == pytest.approx(math.sqrt(9 / 70), rel=1e-5)


# ---------------------------------------------------------------- independent float64 reference
@st.composite
def batches(draw):
    groups = draw(st.integers(1, 3))
    G = draw(st.integers(2, 4))
    K = draw(st.integers(1, 4))
    C = draw(st.integers(1, 6))
    n = groups * G
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    # integer or fractional rewards (thirds, sevenths: values whose fp32 group mean is not exact)
    rewards = torch.randint(0, 3, (n, K), generator=gen).float() / draw(st.sampled_from([1.0, 3.0, 7.0]))
    nan_mask = torch.rand(n, K, generator=gen) < draw(st.sampled_from([0.0, 0.2]))
    rewards[nan_mask] = float("nan")
    lengths = torch.randint(1, C + 1, (n,), generator=gen)
    mask = (torch.arange(C)[None] < lengths[:, None]).long()
    q = torch.rand(n, K, C, generator=gen) * (torch.rand(n, K, 1, generator=gen) < 0.8)  # some all-zero profiles
    c = torch.rand(K, generator=gen) * 2
    beta = draw(st.floats(0.0, 1.0))
    rho = draw(st.floats(1.0, 4.0))
    return rewards, q, mask, c, beta, rho, G


@settings(max_examples=150, deadline=None)
@given(batches())
def test_matches_float64_reference(batch):
    rewards, q, mask, c, beta, rho, G = batch
    adv, varying = group_advantages(rewards, G)
    credit = token_advantages(adv, q, varying, mask, c, beta, rho)
    expected, s_ref = reference_token_advantages(rewards, q, mask, c, beta, rho, G)
    assert credit.cap_factor == pytest.approx(s_ref, rel=1e-4, abs=1e-6)
    torch.testing.assert_close(credit.advantages.double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(credit.advantages).all()
    assert (credit.advantages[mask == 0] == 0).all()  # padded positions exactly 0


@settings(max_examples=150, deadline=None)
@given(batches())
def test_weight_invariants(batch):
    _, q, mask, _, beta, _, _ = batch
    w = token_weights(q, mask[:, None, :], beta)
    lengths = mask.sum(-1, keepdim=True).float()
    informative = (q * mask[:, None]).sum(-1) / lengths >= 1e-8
    means = (w * mask[:, None]).sum(-1) / lengths
    torch.testing.assert_close(means[informative], torch.ones_like(means[informative]))  # average 1
    assert (w[~informative] == 1).all()  # qbar = 0: uniform
    assert (w[mask[:, None].expand_as(w).bool()] >= 1 - beta - 1e-6).all()  # floor 1 - beta


@settings(max_examples=150, deadline=None)
@given(batches())
def test_beta_zero_is_uniform_gdpo(batch):
    rewards, q, mask, c, _, rho, G = batch
    adv, varying = group_advantages(rewards, G)
    credit = token_advantages(adv, q, varying, mask, c, beta=0.0, max_second_moment_ratio=rho)
    uniform = (adv * c).sum(-1)
    tokens = uniform[:, None].expand_as(mask)[mask.bool()]
    std = tokens.std() if tokens.numel() > 1 else torch.tensor(0.0)
    expected = uniform / std if std > 0 else uniform
    torch.testing.assert_close(credit.advantages, (expected[:, None] * mask).float())


@settings(max_examples=150, deadline=None)
@given(batches())
def test_cap_bound(batch):
    rewards, q, mask, c, beta, rho, G = batch
    adv, varying = group_advantages(rewards, G)
    w = torch.where(varying[..., None], token_weights(q, mask[:, None], beta), torch.ones_like(q))
    uniform, redistributed = combine(adv, w, c, mask)
    torch.testing.assert_close(redistributed.sum(-1), torch.zeros(len(mask)), atol=1e-4, rtol=0)
    capped, s = cap_redistribution(uniform, redistributed, mask, rho)
    bound = rho * (mask.sum(-1) * uniform**2).sum()
    assert (capped**2).sum() <= bound * (1 + 1e-5) + 1e-6
    assert 0.0 <= s <= 1.0


def test_group_advantages_match_trl_normalize_then_sum():
    from trl.trainer.utils import nanstd

    gen = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (12, 3), generator=gen).float()
    rewards[3, 1] = float("nan")
    grouped = rewards.view(-1, 4, 3)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    trl_adv = torch.nan_to_num((grouped - mean_k) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)).view(12, 3)
    adv, _ = group_advantages(rewards, 4)
    torch.testing.assert_close(adv, trl_adv)


def test_reward_none_for_a_whole_group_gives_zero_advantage_and_no_replay():
    rewards = torch.tensor([[1.0, float("nan")], [0.0, float("nan")], [1.0, 2.0], [0.0, 1.0]])
    adv, varying = group_advantages(rewards, 2)
    assert adv[:2, 1].tolist() == [0.0, 0.0]
    assert not varying[:2, 1].any()
    assert varying[2:, 1].all()


def test_single_valid_value_in_group_is_not_varying():
    rewards = torch.tensor([[1.0], [float("nan")]])
    adv, varying = group_advantages(rewards, 2)
    assert adv.tolist() == [[0.0], [0.0]] and not varying.any()


def test_group_advantages_rejects_bad_shapes():
    with pytest.raises(ValueError, match="num_generations=3"):
        group_advantages(torch.zeros(4, 2), 3)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        group_advantages(torch.zeros(4), 2)


def test_warmup_schedule():
    assert warmup_beta(0.5, 0, 10) == 0.0
    assert warmup_beta(0.5, 5, 10) == pytest.approx(0.5 * (3 * 0.25 - 2 * 0.125))
    assert warmup_beta(0.5, 10, 10) == 0.5
    assert warmup_beta(0.5, 99, 10) == 0.5
    assert warmup_beta(0.3, 0, 0) == 0.3
    steps = [warmup_beta(1.0, n, 10) for n in range(12)]
    assert steps == sorted(steps)


def test_batch_rescale_leaves_zero_std_unscaled_and_pads_zero():
    scores = torch.tensor([[2.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert batch_rescale(scores, mask).tolist() == [[2.0, 2.0, 0.0]]
    assert batch_rescale(torch.zeros(1, 2), torch.zeros(1, 2)).tolist() == [[0.0, 0.0]]


def test_shuffle_keeps_values_and_pads():
    gen = torch.Generator().manual_seed(0)
    q = torch.rand(3, 2, 5, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    q = q * mask[:, None]
    shuffled = shuffle_relevance(q, mask, torch.Generator().manual_seed(1))
    for b in range(3):
        for k in range(2):
            assert sorted(shuffled[b, k].tolist()) == sorted(q[b, k].tolist())
    assert (shuffled[mask[:, None].expand_as(q) == 0] == 0).all()
    assert not torch.equal(shuffled[0], q[0])


# ---------------------------------------------------------------- constant groups (decided by equality)
FRACTIONS = st.sampled_from([0.05, 0.1, 0.2, 0.35, 0.7, 0.9, 1.0 / 3.0, 2.0 / 3.0, 0.123456789])


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 16), FRACTIONS, st.integers(1, 3))
def test_constant_fractional_group_has_exactly_zero_advantage(group_size, value, num_rewards):
    rewards = torch.full((group_size, num_rewards), value)
    rewards[0, 0] = float("nan") if group_size > 2 else value  # a NaN member does not make it vary
    adv, varying = group_advantages(rewards, group_size)
    assert torch.equal(adv, torch.zeros_like(adv))
    assert not varying.any()


def test_batch_of_constant_groups_gives_all_zero_token_advantages():
    # one reward returning 0.35 for every response, G = 8: fp32 rounding of the mean must not look like signal
    rewards = torch.full((16, 1), 0.35)
    adv, varying = group_advantages(rewards, 8)
    mask = torch.ones(16, 5)
    q = torch.rand(16, 1, 5, generator=torch.Generator().manual_seed(0))
    credit = token_advantages(adv, q, varying, mask, torch.ones(1), beta=0.5)
    assert torch.equal(credit.advantages, torch.zeros(16, 5))


def test_gdpo_mode_matches_trl_normalize_then_sum_for_equal_lengths():
    """Documented relation: at beta 0 with equal completion lengths T, the token-weighted rescale is TRL's
    response-level normalize_then_sum (whose batch mean is 0 up to rounding) times sqrt((B T - 1) / (T (B - 1))),
    up to TRL's +1e-4 on the std."""
    from trl.trainer.utils import nanstd

    gen = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 4, (16, 3), generator=gen).float() / 3
    rewards[5, 1] = float("nan")
    c = torch.tensor([1.0, 0.5, 2.0])
    grouped = rewards.view(-1, 4, 3)
    normalised = (
        (grouped - torch.nanmean(grouped, 1, keepdim=True)) / (nanstd(grouped, 1, keepdim=True) + 1e-4)
    ).view(16, 3)
    summed = (normalised * c).nansum(1)
    trl = (summed - summed.mean()) / (nanstd(summed) + 1e-4)
    adv, varying = group_advantages(rewards, 4)
    mask = torch.ones(16, 7)
    ours = token_advantages(adv, torch.rand(16, 3, 7, generator=gen), varying, mask, c, beta=0.0).advantages
    # Bessel's correction counts tokens (B*T - 1) on our side and responses (B - 1) on TRL's
    bessel = math.sqrt((16 * 7 - 1) / (7 * (16 - 1)))
    torch.testing.assert_close(ours, bessel * trl[:, None].expand(16, 7), atol=1e-3, rtol=1e-3)


# ---------------------------------------------------------------- edge cases that mutation testing found unguarded
def test_a_constant_group_is_not_varying_beside_groups_with_lower_rewards():
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0], [2.0], [2.0]])
    advantages, varying = group_advantages(rewards, num_generations=2)
    assert varying[:, 0].tolist() == [False, False, True, True, False, False]
    assert advantages[[0, 1, 4, 5], 0].abs().max() == 0


def test_a_group_of_one_is_allowed_and_never_varies():
    advantages, varying = group_advantages(torch.tensor([[1.0, 0.0], [0.0, 3.0]]), num_generations=1)
    assert not varying.any() and advantages.abs().max() == 0
    with pytest.raises(ValueError):
        group_advantages(torch.ones(2, 1), num_generations=0)


def test_one_step_warmup():
    assert warmup_beta(0.5, 0, 1) == 0.0 and warmup_beta(0.5, 1, 1) == 0.5 and warmup_beta(0.5, 0, 0) == 0.5


def _two_process_all_reduce():
    """reduce_sum for two threads standing in for two data-parallel processes (an all-reduce by summation)."""
    import threading

    barrier, slots = threading.Barrier(2), [None, None]

    def for_rank(rank):
        def reduce_sum(tensor):
            slots[rank] = tensor
            barrier.wait()
            total = slots[0] + slots[1]
            barrier.wait()  # both have read before either writes again
            return total

        return reduce_sum

    return for_rank


@pytest.mark.parametrize("rho", [1.05, 2.0, None])
def test_two_processes_compute_what_one_computes_on_the_whole_batch(rho):
    """Each half of a batch (whole groups) on its own 'process' gets the same advantages, cap factor and std as one
    process on the whole batch: steps 7 and 8 reduce their sums over processes."""
    import threading

    gen = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 2, (8, 2), generator=gen).float()
    rewards[:4, 0] = torch.tensor([1.0, 0.0, 0.0, 0.0])  # the halves differ in how much they redistribute
    mask = torch.ones(8, 6)
    mask[2, 3:] = 0
    mask[6, 1:] = 0
    q = torch.rand(8, 2, 6, generator=gen) ** 4
    advantages, varying = group_advantages(rewards, num_generations=2)
    whole = token_advantages(advantages, q, varying, mask, torch.ones(2), beta=0.9, max_second_moment_ratio=rho)
    for_rank, results = _two_process_all_reduce(), [None, None]

    def run(rank):
        rows = slice(4 * rank, 4 * rank + 4)
        results[rank] = token_advantages(
            advantages[rows], q[rows], varying[rows], mask[rows], torch.ones(2), 0.9, rho, for_rank(rank)
        )

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    torch.testing.assert_close(torch.cat([r.advantages for r in results]), whole.advantages)
    assert results[0].cap_factor == results[1].cap_factor == pytest.approx(whole.cap_factor, rel=1e-6)
    if rho == 1.05:
        assert whole.cap_factor < 1  # the cap binds, so its reduction matters


def test_a_rounding_sized_redistribution_is_no_redistribution_even_at_rho_one():
    uniform = torch.tensor([1000.0, -1000.0])
    redistributed = torch.tensor([[1e-9, -1e-9], [0.0, 0.0]])
    scores, s = cap_redistribution(uniform, redistributed, torch.ones(2, 2), max_second_moment_ratio=1.0)
    assert s == 1.0 and torch.equal(scores, uniform[:, None] + redistributed)


def test_without_a_cap_padding_stays_zero_and_the_cap_factor_is_one():
    adv, varying = group_advantages(REWARDS, num_generations=2)
    credit = token_advantages(adv, Q, varying, MASK, torch.ones(2), beta=0.5, max_second_moment_ratio=None)
    assert credit.cap_factor == 1.0
    assert credit.advantages[1, 2] == 0  # padding
    torch.testing.assert_close(credit.advantages, HAND_EXPECTED)  # the hand example's cap is inactive anyway


def test_the_default_cap_is_rho_two():
    adv, varying = group_advantages(REWARDS, num_generations=2)
    peaked = torch.zeros(2, 2, 3)
    peaked[0, 0] = torch.tensor([1.0, 0.0, 0.0])
    default = token_advantages(adv, peaked, varying, MASK, torch.ones(2), beta=1.0)
    explicit = token_advantages(adv, peaked, varying, MASK, torch.ones(2), beta=1.0, max_second_moment_ratio=2.0)
    other = token_advantages(adv, peaked, varying, MASK, torch.ones(2), beta=1.0, max_second_moment_ratio=3.0)
    assert default.cap_factor == explicit.cap_factor < other.cap_factor <= 1.0


def test_shuffling_is_reproducible_from_its_generator():
    q = torch.rand(3, 2, 7)
    mask = torch.ones(3, 7)

    def shuffled(seed):
        return shuffle_relevance(q, mask, torch.Generator().manual_seed(seed))

    assert torch.equal(shuffled(0), shuffled(0)) and not torch.equal(shuffled(0), shuffled(1))


@pytest.mark.parametrize("configured", [0.1, 0.25, 5])
def test_the_warmup_warning_contradicts_itself_at_max_steps_1(configured):
    """At max_steps=1 the one step samples at global_step 0, where beta is 0 whatever the warm-up: the warning says so,
    and advises no warm-up (it said beta reaches the target and advised 'at most 0 (or a share such as 0.25)', and a
    share of one step rounds up to that step)."""
    steps = warmup_steps(configured, 1)
    assert warmup_beta(0.5, 0, steps) == 0.0
    message = short_run_warning(1, configured, steps, 0.5)
    assert "beta reaches 0 of 0.5 by the last step" in message
    assert message.endswith("Set credit_warmup_steps=0 (no warm-up) for a short run.")
    # longer runs: the last step's beta (global_step max_steps - 1), and a share that fits in half the run
    assert "beta reaches 0.39 of 0.5" in short_run_warning(8, 10, 10, 0.5)
    assert "at most 4 (or a share such as 0.25)" in short_run_warning(8, 10, 10, 0.5)
