"""Per-reward strength (docs/method.md, step 5; on by default): the specificity reading and the strength against
hand-worked examples and float64 loops, its reduction over processes, and the trainer's wiring (per-reward beta,
resting rewards, logs, checkpointed state, the published rule with ``reward_strength_floor=None``)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_args, token_advantages, train
from tests.reference import reference_specificity, reference_strength_betas
from trl_mrtpo import MRTPOConfig
from trl_mrtpo.credit import group_advantages, relevance_specificity, reward_strength
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.strength import RewardStrength


def test_specificity_and_strength_by_hand():
    q = torch.tensor(
        [
            [[1.0, 0.0], [0.0, 1.0], [9.0, 9.0]],  # orthogonal profiles: each stands out fully
            [[0.4, 0.2], [0.2, 0.1], [0.0, 0.0]],  # reward 1 has reward 0's shape: no specificity; 2 not replayed
            [[0.5, 0.5], [0.0, 0.0], [0.0, 0.0]],  # no control in the response: no reading
        ]
    )
    replayed = torch.tensor([[True, True, False], [True, True, False], [True, False, False]])
    reading = relevance_specificity(q, replayed)
    # reward 0: 1 - cos = 1 (response 0) and 0 (response 1); reward 1 the same; reward 2 never read
    torch.testing.assert_close(reading[:2], torch.tensor([0.5, 0.5], dtype=torch.float64))
    assert math.isnan(reading[2].item())
    strength = reward_strength(torch.tensor([0.2, 0.25, 0.375, 0.6, math.nan], dtype=torch.float64), 0.25)
    torch.testing.assert_close(strength, torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0], dtype=torch.float64))


def random_profiles(n, k_count, c_len, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(n, k_count, c_len, generator=gen) * (torch.rand(n, k_count, 1, generator=gen) < 0.8)
    return q, torch.rand(n, k_count, generator=gen) < 0.7


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_specificity_matches_float64_loops(n, k_count, c_len, seed):
    q, replayed = random_profiles(n, k_count, c_len, seed)
    reading = relevance_specificity(q, replayed)
    for k, expected in enumerate(reference_specificity(q, replayed)):
        if math.isnan(expected):
            assert math.isnan(reading[k].item())
        else:
            assert reading[k].item() == pytest.approx(expected, abs=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 6), st.integers(2, 4), st.integers(1, 6), st.integers(0, 2**31 - 1))
def test_reading_over_two_processes_equals_one_process_on_the_whole_batch(n, k_count, c_len, seed):
    """Each rank reads its own slice; summed over ranks (sum and count), every rank gets the whole batch's mean."""
    q, replayed = random_profiles(n, k_count, c_len, seed)
    half = n // 2
    slices = [(q[:half], replayed[:half]), (q[half:], replayed[half:])]

    def partial(part):  # what a rank contributes: its reading summed and counted, via an identity "reduction"
        sums = []
        relevance_specificity(*part, reduce_sum=lambda t: sums.append(t) or t)
        return sums[0]

    contributions = [partial(part) for part in slices]
    whole = relevance_specificity(q, replayed)
    for rank, part in enumerate(slices):
        other = contributions[1 - rank]
        read = relevance_specificity(*part, reduce_sum=lambda t, other=other: t + other)
        torch.testing.assert_close(read, whole, equal_nan=True)


def test_per_reward_beta_is_each_rewards_own_beta():
    """A [K] beta gives reward k exactly the weights of a scalar beta_k: [0.5, 0] equals reward 1 not replayed."""
    gen = torch.Generator().manual_seed(0)
    adv, _ = group_advantages(torch.randint(0, 2, (4, 2), generator=gen).float(), 4)
    q, mask = torch.rand(4, 2, 5, generator=gen), torch.ones(4, 5, dtype=torch.long)
    replayed, c = torch.ones(4, 2, dtype=torch.bool), torch.ones(2)
    per_reward = token_advantages(adv, q, replayed, mask, c, torch.tensor([0.5, 0.0]))
    only_first = token_advantages(adv, q, torch.tensor([[True, False]] * 4), mask, c, 0.5)
    torch.testing.assert_close(per_reward.advantages, only_first.advantages)


def test_running_strength_follows_the_float64_reference():
    """Three readings (one reward never read): the state's betas equal the reference's running mean, step by step;
    off (floor None), beta_n is returned as it is."""
    readings = [random_profiles(6, 3, 5, seed) for seed in range(3)]
    for reading in readings:
        reading[1][:, 2] = False
    strength = RewardStrength(0.3, 3)
    expected = reference_strength_betas(readings, [0.5] * 3, 0.3, num_rewards=3)
    for reading, betas in zip(readings, expected):
        strength.read(*reading, reduce_sum=None)
        torch.testing.assert_close(strength.betas(0.5).double(), torch.tensor(betas, dtype=torch.float64))
    assert strength.betas(0.5)[2] == 0.5  # never read: full strength
    assert RewardStrength(None, 3).betas(0.5) == 0.5


def test_resting_rewards_wait_for_warmup_and_probe_every_tenth_generation_batch():
    strength = RewardStrength(0.25, 3)
    strength.specificity = torch.tensor([0.1, 0.5, math.nan], dtype=torch.float64)  # g = 0, 1, 1 (no reading)
    assert strength.resting(step=4, warmup_steps=5, generation_batch=4) == set()
    assert strength.resting(step=11, warmup_steps=5, generation_batch=11) == {0}
    assert strength.resting(step=20, warmup_steps=5, generation_batch=20) == set()  # probe: its reading is refreshed
    # a generation every 4 steps: the probe is the 10th batch's (step 40), not step 20's (the 5th batch)
    assert strength.resting(step=20, warmup_steps=5, generation_batch=5) == {0}
    assert strength.resting(step=40, warmup_steps=5, generation_batch=10) == set()
    assert RewardStrength(None, 3).resting(step=11, warmup_steps=0, generation_batch=11) == set()


@pytest.mark.parametrize(
    "accumulation,per_generation,iterations,expected",
    [(1, 1, 1, [0, 1, 2, 3]), (1, 4, 1, [0, 1, 2]), (2, 2, 2, [0, 1]), (4, 2, 1, [0, 2, 4])],
)
def test_the_generation_batch_index_counts_what_trl_samples(accumulation, per_generation, iterations, expected):
    """TRL samples every ``steps_per_generation x num_iterations`` micro-batches; read at the optimizer steps where it
    samples (every step with 2 generations per step in the last case: one is read per step at its first)."""
    from trl_mrtpo.strength import generation_batch_index

    period = max(per_generation * iterations // accumulation, 1)
    steps = range(0, len(expected) * period, period)
    assert [generation_batch_index(s, accumulation, per_generation, iterations) for s in steps] == expected


def test_the_trainer_reads_generation_batches_for_the_probe(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    """A generation every 4 optimizer steps (steps_per_generation=4): the probe counter sees batches 0, 1, 2 at steps
    0, 4, 8 (it read the step before: 0, 4, 8, whose 10th multiple came every 5 batches)."""
    from tests.helpers import make_args, make_basic_dataset
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits import get_kit

    seen = []
    original = RewardStrength.resting

    def recording(self, step, warmup_steps, generation_batch):
        seen.append((step, generation_batch))
        return original(self, step, warmup_steps, generation_batch)

    monkeypatch.setattr(RewardStrength, "resting", recording)
    kit = get_kit("basic")
    args = make_args(tmp_path, max_steps=12, steps_per_generation=4, per_device_train_batch_size=4)
    MRTPOTrainer(
        model=tiny_model, reward_funcs=kit.rewards, info_blocks=kit.info_blocks, args=args,
        train_dataset=make_basic_dataset(16), processing_class=tiny_tokenizer,
    ).train()  # fmt: skip
    assert seen == [(0, 0), (4, 1), (8, 2)]


def test_trainer_per_reward_strength_rests_background_rewards(tiny_model, tiny_tokenizer, tmp_path):
    """The default config: readings are taken, beta per reward is logged, a reward whose strength is 0 is not
    replayed after warm-up (except on probe steps), and the running specificity is checkpointed."""
    trainer = train(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        dataset=make_basic_dataset(12),
        max_steps=3,
        reward_strength_floor=0.5,  # 1 - cos below 0.5 rests a reward: q profiles of one prompt look alike
        save_strategy="steps",
        save_steps=3,
    )
    specificity = trainer.reward_strength.specificity
    assert not torch.isnan(specificity).all()
    logged = trainer.state.log_history[1]
    name = next(n for n, s in zip(trainer.reward_func_names, specificity) if not torch.isnan(s))
    assert logged[f"mrtpo/beta/{name}"] == 0.0
    # step 0 is a probe (replayed), steps 1 and 2 rest every reward that has a reading
    read = ~torch.isnan(specificity)
    assert trainer.replays[0]["replayed"].any()
    for replay in trainer.replays[1:]:
        assert not replay["replayed"][:, read].any()
    state = torch.load(tmp_path / "checkpoint-3" / "mrtpo_state_0.pt", weights_only=True)  # plain data only
    saved = state["parts"]["per-reward strength"]["specificity"]
    torch.testing.assert_close(saved, specificity, equal_nan=True)


def test_published_rule_with_floor_none(tiny_model, tiny_tokenizer, tmp_path):
    """reward_strength_floor=None: one beta for every reward, no per-reward logs, every varying pair replayed."""
    trainer = train(tiny_model, tiny_tokenizer, tmp_path, max_steps=2, reward_strength_floor=None)
    assert not trainer.reward_strength.active and torch.isnan(trainer.reward_strength.specificity).all()
    assert not any(key.startswith("mrtpo/beta/") for entry in trainer.state.log_history for key in entry)
    assert torch.all(trainer.last_credit.reward_betas == trainer.last_credit.beta)
    assert all(replay["replayed"].any() for replay in trainer.replays)


@pytest.mark.parametrize("floor", [0.0, 0.6])
def test_floor_range(tmp_path, floor):
    with pytest.raises(ValueError, match=r"reward_strength_floor must be in \(0, 0.5\] or None"):
        make_args(tmp_path, reward_strength_floor=floor)


@pytest.mark.parametrize("mode", ["gdpo", "grpo"])
def test_a_floor_that_would_do_nothing_is_refused(tmp_path, mode):
    """Where the trainer resolves the rule, before the model loads (the configuration does not know the rules)."""
    from trl_mrtpo.checks.inputs import check_credit_settings
    from trl_mrtpo.rules import resolve_credit_rule

    def check(**fields):
        args = make_args(tmp_path, credit_assignment=mode, **fields)
        check_credit_settings(args, resolve_credit_rule(args))
        return args

    with pytest.raises(ValueError, match="reward_strength_floor=0.3 has no effect unless credit_assignment"):
        check(reward_strength_floor=0.3)
    # the default (on) and None are accepted everywhere: the default must not refuse gdpo
    assert MRTPOConfig.__dataclass_fields__["reward_strength_floor"].default == 0.25
    assert check(reward_strength_floor=0.25).reward_strength_floor == 0.25
    assert check(reward_strength_floor=None).reward_strength_floor is None


def test_a_process_without_its_own_state_file_reads_the_lowest_ranks(tmp_path, caplog):
    """The core state is global: a resume on more processes (or from a checkpoint only the main process uploaded)
    gives a new rank the lowest rank's state, not a fresh strength beside ranks that rest rewards."""
    from trl_mrtpo.state import CheckpointedState
    from trl_mrtpo.strength import RewardStrength

    identity = {"reward_names": ["a", "b"], "credit_assignment": "mrtpo"}
    for rank, value in ((1, 0.3), (3, 0.7)):
        strength = RewardStrength(0.25, 2)
        strength.specificity = torch.tensor([value, math.nan], dtype=torch.float64)
        CheckpointedState(identity, {"per-reward strength": strength}).write(str(tmp_path), rank)
    for rank, expected in ((0, 0.3), (1, 0.3), (2, 0.3), (3, 0.7), (5, 0.3)):
        strength = RewardStrength(0.25, 2)
        CheckpointedState(identity, {"per-reward strength": strength}).read(str(tmp_path), rank)
        assert strength.specificity[0].item() == expected, rank
    assert not caplog.records  # nothing was missing


def test_a_warmup_share_rests_rewards_after_the_same_whole_steps_as_beta(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    """credit_warmup_steps=0.5 of 6 steps is 3 steps for beta's ramp and for the rest alike (the rest read 0.5: rewards
    rested from step 1)."""
    from tests.helpers import make_args, make_basic_dataset
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits import get_kit

    seen = []
    original = RewardStrength.resting

    def recording(self, step, warmup_steps, generation_batch):
        seen.append(warmup_steps)
        return original(self, step, warmup_steps, generation_batch)

    monkeypatch.setattr(RewardStrength, "resting", recording)
    kit = get_kit("basic")
    args = make_args(
        tmp_path, max_steps=6, credit_warmup_steps=0.5, reward_strength_floor=0.5, max_completion_length=4
    )
    MRTPOTrainer(
        model=tiny_model, reward_funcs=kit.rewards, info_blocks=kit.info_blocks, args=args,
        train_dataset=make_basic_dataset(24), processing_class=tiny_tokenizer,
    ).train()  # fmt: skip
    assert seen and set(seen) == {3}
