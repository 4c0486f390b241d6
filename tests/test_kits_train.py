"""Each task kit trains 2 MRTPO steps on the tiny model, with its rewards and info blocks wired in."""

import pytest
import torch
from hypothesis import given, settings

from tests.conftest import MALFORMED_COMPLETIONS
from tests.test_trainer import RecordingTrainer, make_args
from trl_mrtpo.demo import DEMO_TASKS, demo_task
from trl_mrtpo.info_blocks import InfoBlock


@pytest.mark.parametrize("task", ["sql", "if", "tools", "short"])
def test_kit_trains_two_steps(tiny_model, tiny_tokenizer, tmp_path, task):
    rewards, blocks, dataset = demo_task(task, num_prompts=8, seed=0, cache_dir=str(tmp_path / "db"))
    trainer = RecordingTrainer(
        model=tiny_model,
        reward_funcs=rewards,
        info_blocks=blocks,
        args=make_args(tmp_path / "out", max_completion_length=8),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    for batch in trainer.batches:
        assert batch["advantages"].shape == batch["completion_ids"].shape
        assert torch.isfinite(batch["advantages"]).all()
    # replay_only_varying=False: every pair with a block was replayed through the kit's builders
    assert trainer.replays and all(r["replayed"].any() for r in trainer.replays)


def test_sql_kit_blocks_build_real_contexts(tmp_path):
    rewards, blocks, dataset = demo_task("sql", num_prompts=8, seed=0, cache_dir=str(tmp_path))
    row = dataset[0]
    built = [b(prompt=row["prompt"], completion="```sql\nSELECT nope FROM x\n```", row=row, score=0.0) for b in blocks]
    assert "no such table: x" in built[1]
    assert row["query"] in built[2]


def test_unknown_demo_task():
    assert DEMO_TASKS == ("basic", "sql", "if", "tools", "short")
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        demo_task("chess", 8, 0, "/tmp")


def test_if_kit_in_prompt_blocks_are_spans():
    _, blocks, dataset = demo_task("if", num_prompts=4, seed=1, cache_dir="")
    row = dataset[0]
    block = blocks[0](prompt=row["prompt"], completion="", row=row, score=1.0)
    assert isinstance(block, InfoBlock) and block.text in row["prompt"][0]["content"]


@settings(max_examples=200, deadline=None)
@given(MALFORMED_COMPLETIONS)
def test_basic_demo_rewards_never_raise(junk):
    rewards, _, dataset = demo_task("basic", num_prompts=1, seed=0, cache_dir="")
    row = dataset[0]
    for reward in rewards:
        assert reward([junk], end_phrase=[row["end_phrase"]], keyword=[row["keyword"]]) in ([0.0], [1.0])


def test_short_answer_rewards_by_hand():
    from trl_mrtpo.reward_funcs.short_answers import (
        brevity_reward,
        ending_reward,
        keyword_reward,
        opening_reward,
    )

    replies = ["The apple is nice!", "  a pear, a great one.", "Apples.", "", "The " + "very " * 12 + "long one!"]
    assert opening_reward(replies, opening=["The", "A", "The", "The", "the"]) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert keyword_reward(replies, keyword=["nice", "great", "nice", "nice", "great"]) == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert brevity_reward(replies) == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert ending_reward(replies) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert opening_reward([[{"role": "assistant", "content": "A cat."}]], opening=["A"]) == [1.0]


def test_short_answer_blocks_are_unique_spans():
    _, blocks, dataset = demo_task("short", num_prompts=6, seed=2)
    for row in dataset:
        text = row["prompt"][0]["content"]
        for block in blocks:
            built = block(prompt=row["prompt"], completion="", row=row, score=0.0)
            assert built.placement == "in_prompt" and text.count(built.text) == 1


def test_short_answer_checkable_spans():
    from trl_mrtpo.inspection import checkable_spans

    text = "The sun is nice today!"
    spans = checkable_spans("short", {"keyword": "nice"}, text)
    assert [text[a:b] for a, b in spans[0][1]] == ["The"]
    assert [text[a:b] for a, b in spans[1][1]] == ["nice"]
    assert [text[a:b] for a, b in spans[3][1]] == ["!"]
    assert checkable_spans("short", {"keyword": "nice"}, "no mark")[3][1] == []
