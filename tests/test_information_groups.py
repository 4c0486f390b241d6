"""Information groups (docs/method.md steps 2 and 5): rewards whose blocks carry one text share it. ``P_all`` holds it
once, removing it for one member removes it for the group, every replayed member gets the group's q, and per-reward
strength compares a reward with the other groups, never with its twins."""

import math
import warnings

import pytest
import torch
from datasets import Dataset

from tests.helpers import make_args, recording_trainer
from tests.reference import reference_specificity
from trl_mrtpo.checks.batch import check_spans
from trl_mrtpo.credit import relevance_specificity
from trl_mrtpo.info_blocks import InfoBlock, build_contexts, information_groups, leaked_information, removed_groups
from trl_mrtpo.replay import placed_relevance
from trl_mrtpo.research.credit import null_corrected_relevance
from trl_mrtpo.strength import RewardStrength

CHAT = [{"role": "user", "content": "Write the query."}]
GOLD = "Reference query: SELECT id FROM t"


def test_groups_compare_stripped_text_and_leave_rewards_without_blocks_alone():
    blocks = [InfoBlock(GOLD), None, InfoBlock(f"  {GOLD}\n"), InfoBlock("Format: one line."), InfoBlock(GOLD)]
    assert information_groups(blocks) == [0, 1, 0, 3, 0]
    assert removed_groups([4, 3, 0, 2], information_groups(blocks)) == [0, 3]


def test_a_shared_block_is_carried_once_and_removed_for_the_whole_group():
    blocks = [InfoBlock(GOLD), InfoBlock(GOLD + "  "), InfoBlock("Format: one line.")]
    p_all, (without_first, without_second, without_format) = build_contexts(CHAT, blocks, [[0], [1], [2]])
    assert p_all[0]["content"] == f"Write the query.\n\n{GOLD}\n\nFormat: one line."
    assert without_first == without_second  # one piece of information, removed for the group
    assert without_first[0]["content"] == "Write the query.\n\nFormat: one line."
    assert without_format[0]["content"] == f"Write the query.\n\n{GOLD}"


def test_the_span_wins_over_an_appended_copy_and_identical_spans_are_one():
    prompt = [{"role": "user", "content": "Name a colour. End with !"}]
    span, appended = InfoBlock("End with !", "in_prompt"), InfoBlock("End with !")
    for blocks in ([appended, span], [span, appended], [span, span]):
        check_spans(prompt, blocks, ["a", "b"], 0)  # one span, not two overlapping ones
        p_all, (without_a, without_b) = build_contexts(prompt, blocks, [[0], [1]])
        assert p_all == prompt  # the text is already in the prompt: nothing appended
        assert without_a == without_b == [{"role": "user", "content": "Name a colour."}]


def test_each_wanted_member_gets_its_groups_row_of_q():
    mask = torch.ones(2, 3)
    q = [torch.tensor([[0.1, 0.2, 0.3], [0.7, 0.8, 0.9]]), torch.tensor([[0.4, 0.5, 0.6]])]
    wanted, groups = [[0, 1, 2], [1]], [[0, 0, 2], [0, 1, 2]]
    relevance, replayed = placed_relevance(q, wanted, mask, 3, groups=groups)
    assert replayed.tolist() == [[True, True, True], [False, True, False]]
    torch.testing.assert_close(relevance[0, 0], q[0][0], rtol=0, atol=0)
    torch.testing.assert_close(relevance[0, 1], q[0][0], rtol=0, atol=0)  # the twin: its group's row
    torch.testing.assert_close(relevance[0, 2], q[0][1], rtol=0, atol=0)
    torch.testing.assert_close(relevance[1, 1], q[1][0], rtol=0, atol=0)


def _profiles(n, k, c, seed, twins):
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(n, k, c, generator=gen)
    q[:, 1] = q[:, 0]  # rewards 0 and 1 are twins: one group, one q
    replayed = torch.rand(n, k, generator=gen) > 0.2
    groups = torch.arange(k).expand(n, k).clone()
    if twins:
        groups[:, 1] = 0
    return q, replayed, groups


@pytest.mark.parametrize("seed", range(4))
def test_strength_compares_a_reward_with_the_other_groups_never_its_twin(seed):
    q, replayed, groups = _profiles(9, 4, 11, seed, twins=True)
    got = relevance_specificity(q, replayed, groups=groups)
    expected = reference_specificity(q, replayed, groups.tolist())
    for k in range(4):
        assert (math.isnan(got[k]) and math.isnan(expected[k])) or abs(got[k].item() - expected[k]) < 1e-12
    # as if reward 1 had no block: reward 0's reading is the one it gets with its twin
    alone = replayed.clone()
    alone[:, 1] = False
    assert abs(relevance_specificity(q, alone)[0].item() - got[0].item()) < 1e-12 or replayed[:, 0].sum() == 0


def test_twins_alone_give_no_reading_instead_of_resting_each_other():
    q = torch.rand(3, 2, 5)
    q[:, 1] = q[:, 0]
    replayed = torch.ones(3, 2, dtype=torch.bool)
    assert relevance_specificity(q, replayed).tolist() == pytest.approx([0.0, 0.0], abs=1e-12)  # the old reading
    assert torch.isnan(relevance_specificity(q, replayed, groups=torch.zeros(3, 2, dtype=torch.long))).all()


def test_null_correction_skips_twins():
    q, replayed, groups = _profiles(5, 3, 7, 0, twins=True)
    replayed[:] = True
    corrected = null_corrected_relevance(q, replayed, groups)
    # reward 0's control is reward 2 alone (its twin would zero it)
    torch.testing.assert_close(corrected[:, 0], (q[:, 0] - q[:, 2]).clamp(min=0))
    # twins with no other group: each keeps its profile (as a reward alone does) instead of zeroing the other's
    pair, both = q[:, :2], torch.ones(5, 2, dtype=torch.bool)
    assert null_corrected_relevance(pair, both).abs().max() == 0
    torch.testing.assert_close(null_corrected_relevance(pair, both, groups[:, :2]), pair, rtol=0, atol=0)


@pytest.mark.parametrize("seed", range(200))
def test_every_drawn_state_of_the_strength_is_written_and_read_back(seed):
    """Parallel, orthogonal and random float32 profiles, twins included, folded into the running specificity: every
    value stays in [0, 1] and passes the state's own check."""
    gen = torch.Generator().manual_seed(seed)
    n, k, c = 16, 3, 24
    kind = seed % 4
    base = torch.rand(n, 1, c, generator=gen)
    if kind == 0:  # parallel: scaled copies of one profile
        q = base * torch.rand(n, k, 1, generator=gen) * 3
    elif kind == 1:  # orthogonal: disjoint supports
        q = torch.zeros(n, k, c)
        for i in range(k):
            q[:, i, i::k] = torch.rand(n, len(range(i, c, k)), generator=gen)
    elif kind == 2:
        q = torch.rand(n, k, c, generator=gen)
    else:  # twins
        q = base.expand(n, k, c).clone()
    q = q.float()
    strength = RewardStrength(0.5, k)
    groups = torch.zeros(n, k, dtype=torch.long) if kind == 3 and seed % 8 == 3 else None
    for _ in range(3):
        strength.read(q, torch.ones(n, k, dtype=torch.bool), None, groups)
    read = strength.state()["specificity"]
    known = read[~read.isnan()]  # NaN: no reading yet
    assert read.dtype == torch.float64 and read.shape == (k,) and ((known >= 0) & (known <= 1)).all()
    restored = RewardStrength(0.5, k)
    restored.restore(strength.state())
    torch.testing.assert_close(restored.specificity, strength.specificity, equal_nan=True)


def test_a_block_contained_in_another_or_repeating_the_prompt_is_found():
    prompt = [{"role": "user", "content": "Write the query. Answer in one line."}]
    blocks = [InfoBlock(GOLD), InfoBlock(f"Compare with this. {GOLD}"), InfoBlock("Answer in one line.")]
    groups = information_groups(blocks)
    _, removed = build_contexts(prompt, blocks, [[0], [1], [2]])
    leaks = leaked_information(removed, [0, 1, 2], blocks, groups, ["exec", "match", "format"])
    assert leaks == {"exec": "the info block of reward 'match'", "format": "the prompt"}


def test_canonically_equal_block_texts_are_two_groups():
    """The same words in NFC and NFD form (what a normalising tokenizer makes the same tokens) are one information
    group, and a block whose NFD form the prompt or another block holds is a leak; the prompt and the blocks the
    model reads are not rewritten (they were two groups, and no leak was found)."""
    import unicodedata

    composed = "Reference: café crème"
    decomposed = unicodedata.normalize("NFD", composed)
    assert composed != decomposed
    blocks = [InfoBlock(composed), InfoBlock(decomposed), InfoBlock("Answer in one line.")]
    assert information_groups(blocks) == [0, 0, 2]
    prompt = [{"role": "user", "content": f"Write the query. {decomposed}"}]
    blocks = [InfoBlock(composed), InfoBlock(f"See: {decomposed}!"), InfoBlock("Answer in one line.")]
    groups = information_groups(blocks)
    p_all, removed = build_contexts(prompt, blocks, [[0], [1], [2]])
    assert decomposed in p_all[0]["content"] and composed in p_all[0]["content"]  # as given
    leaks = leaked_information(removed, [0, 1, 2], blocks, groups, ["exec", "match", "format"])
    assert leaks == {"exec": "the info block of reward 'match'"}  # the prompt holds it too: the block is named first


def _data(rows=4):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": f"Question {i}?"}]} for i in range(rows)])


def exec_reward(completions, **_):
    return [float(len(c[-1]["content"]) % 3) for c in completions]


def match_reward(completions, **_):
    return [float(len(c[-1]["content"]) % 2) for c in completions]


def format_reward(completions, **_):
    return [float(c[-1]["content"].count("a") % 4) for c in completions]


def gold_block(**_):
    return GOLD


def format_block(**_):
    return "Format: answer in one line."


def _first_credit(tiny_model, tiny_tokenizer, tmp_path, blocks):
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[exec_reward, match_reward, format_reward],
        info_blocks=blocks,
        args=make_args(tmp_path, max_steps=1, reward_strength_floor=0.003, max_completion_length=8),
        train_dataset=_data(),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    return trainer


def test_two_rewards_given_one_builder_keep_the_credit_of_one_owner(tiny_tokenizer, tmp_path):
    """The user's case: exec and match both judge against the gold query. Each twin's q and beta equal those of exec
    alone (match's block None) to 1e-12, with strength above 0 and non-uniform weights."""
    from tests.conftest import build_tiny_model

    shared_run = _first_credit(
        build_tiny_model(tiny_tokenizer), tiny_tokenizer, tmp_path / "a", [gold_block] * 2 + [format_block]
    )
    owned_run = _first_credit(
        build_tiny_model(tiny_tokenizer), tiny_tokenizer, tmp_path / "b", [gold_block, None, format_block]
    )
    shared, owned = shared_run.credits[0], owned_run.credits[0]
    shared_run.create_model_card()
    card = (tmp_path / "a" / "README.md").read_text()
    assert "`gold_block`, shared with `match_reward`: one piece of information" in card
    assert shared.completions == owned.completions
    assert shared.replayed[:, 1].any() and not owned.replayed[:, 1].any()
    for twin in (0, 1):
        torch.testing.assert_close(shared.relevance[:, twin], owned.relevance[:, 0], rtol=0, atol=1e-12)
        assert abs(shared.reward_betas[twin].item() - owned.reward_betas[0].item()) < 1e-12
        assert shared.reward_betas[twin] > 0
        weights = shared.weights[:, twin][shared.replayed[:, twin]]
        torch.testing.assert_close(weights, owned.weights[:, 0][shared.replayed[:, twin]], rtol=0, atol=1e-6)
        assert (weights - 1).abs().max() > 1e-3  # token credit, not GDPO's uniform spreading


def test_a_leaking_block_is_warned_about_once_naming_the_reward_and_the_holder(tiny_model, tiny_tokenizer, tmp_path):
    blocks = [gold_block, lambda **_: f"Compare with this. {GOLD}", format_block]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = recording_trainer(
            model=tiny_model,
            reward_funcs=[exec_reward, match_reward, format_reward],
            info_blocks=blocks,
            args=make_args(tmp_path, max_steps=2, max_completion_length=6),
            train_dataset=_data(),
            processing_class=tiny_tokenizer,
        )
        trainer.train()
    leaks = [str(w.message) for w in caught if "still in the context that removes it" in str(w.message)]
    assert len(leaks) == 1 and "'exec_reward'" in leaks[0] and "reward 'match_reward'" in leaks[0]
    assert trainer.information_leaks == {"exec_reward": "the info block of reward 'match_reward'"}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    ["shared blocks", "one reward", "three rewards", "bf16", "gradient accumulation"],
)
def test_a_runs_own_checkpoint_resumes(tiny_tokenizer, tmp_path, case):
    """Five runs that write a checkpoint at step 2 and resume from it to step 4: each resumes (the strength's state
    its own run wrote is never refused), and the resumed run's last advantages equal the uninterrupted run's."""
    from tests.conftest import build_tiny_model
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    rewards, blocks, dataset = [exec_reward, match_reward, format_reward], [gold_block] * 2 + [format_block], _data(8)
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, reward_strength_floor=0.25)
    if case == "one reward":
        rewards, blocks = [exec_reward], [gold_block]
    elif case == "three rewards":
        rewards, blocks, dataset = BASIC.rewards, BASIC.info_blocks, make_basic_dataset(8)
    elif case == "bf16":
        settings["bf16"] = True
    elif case == "gradient accumulation":
        settings.update(gradient_accumulation_steps=2, per_device_train_batch_size=2)

    def run(folder, resume=None):
        trainer = recording_trainer(
            model=build_tiny_model(tiny_tokenizer),
            reward_funcs=rewards,
            info_blocks=blocks,
            args=make_args(folder, max_completion_length=6, **settings),
            train_dataset=dataset,
            processing_class=tiny_tokenizer,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    whole = run(tmp_path / "whole")
    resumed = run(tmp_path / "whole", resume=str(tmp_path / "whole" / "checkpoint-2"))
    torch.testing.assert_close(resumed.reward_strength.specificity, whole.reward_strength.specificity, equal_nan=True)
    torch.testing.assert_close(resumed.batches[-1]["advantages"], whole.batches[-1]["advantages"])
