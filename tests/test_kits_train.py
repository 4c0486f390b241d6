"""Each task kit trains 2 MRTPO steps on the tiny model, with its rewards and info blocks wired in."""

import pytest
import torch
from hypothesis import given, settings

from tests.conftest import MALFORMED_COMPLETIONS
from tests.helpers import make_args, recording_trainer
from trl_mrtpo.info_blocks import InfoBlock
from trl_mrtpo.kits import KIT_NAMES, SINGLE_TURN_KITS, data_loaders, get_kit, resolve


def demo_task(task: str, num_prompts: int, seed: int, cache_dir: str | None = None):
    kit = get_kit(task)
    return kit.rewards, kit.info_blocks, kit.dataset(num_prompts, seed, cache_dir or None)


@pytest.mark.parametrize("task", ["sql", "if", "tools", "short"])
def test_kit_trains_two_steps(tiny_model, tiny_tokenizer, tmp_path, task):
    rewards, blocks, dataset = demo_task(task, num_prompts=8, seed=0, cache_dir=str(tmp_path / "db"))
    trainer = recording_trainer(
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
    assert KIT_NAMES == ("basic", "sql", "if", "tools", "agent", "short")
    assert SINGLE_TURN_KITS == ("basic", "sql", "if", "tools", "short")  # what the demo and inspect offer
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        demo_task("chess", 8, 0, "/tmp")


@pytest.mark.parametrize("task", KIT_NAMES)
def test_every_kit_is_one_consistent_record(task, tmp_path):
    kit = get_kit(task)
    assert kit.name == task and kit.description
    assert len(kit.rewards) == len(kit.info_blocks) >= 2
    names = [f.__name__ for f in kit.rewards]
    assert len(set(names)) == len(names)
    for name in names:  # the registry of names finds each reward of each kit
        assert resolve(name, "reward") is kit.rewards[names.index(name)]
    dataset = kit.dataset(3, 0, str(tmp_path))
    assert len(dataset) > 0 and "prompt" in dataset.column_names
    if kit.environment is not None:  # a multi-turn kit: its rewards read trajectories, not spans of one text
        assert task not in SINGLE_TURN_KITS and len(kit.failure_boundaries) == len(names)
        return
    assert kit.spans is not None
    spans = kit.spans(dataset[0], "Sure: the end")
    assert set(spans) <= set(names)  # spans are keyed by reward name, never by position


def test_kit_registry_rejects_what_it_does_not_know():
    from trl_mrtpo.kits import Kit

    with pytest.raises(ValueError, match="2 rewards but 1 info blocks"):
        Kit("x", "x", [len, len], [None], dataset=list)
    assert set(data_loaders()) == {"spider", "bird", "hir", "rlla"}
    with pytest.raises(ValueError, match="needs data_path and data_split_file"):
        data_loaders()["spider"](None, None)
    with pytest.raises(ValueError, match="rlla needs data_path"):
        data_loaders()["rlla"](None, None)
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        resolve("nope", "reward")


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
    from trl_mrtpo.kits.short_answers import (
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
    spans_of = get_kit("short").spans
    text = "The sun is nice today!"
    spans = spans_of({"keyword": "nice"}, text)
    assert [text[a:b] for a, b in spans["opening_reward"][1]] == ["The"]
    assert [text[a:b] for a, b in spans["keyword_reward"][1]] == ["nice"]
    assert [text[a:b] for a, b in spans["ending_reward"][1]] == ["!"]
    assert spans_of({"keyword": "nice"}, "no mark")["ending_reward"][1] == []
