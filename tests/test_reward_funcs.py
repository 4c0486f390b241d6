"""The example rewards and info blocks of reward_funcs/: hand-worked cases, malformed output, and a training run."""

import json

import pytest
import torch
from hypothesis import given, settings

from reward_funcs.reference import answer_matches_reference, extract_answer, normalise, reference_block
from reward_funcs.structured import json_schema_reward, parse_json_reply, satisfies, schema_block
from reward_funcs.text import format_block, length_reward, regex_format_reward
from tests.conftest import MALFORMED_COMPLETIONS
from tests.helpers import make_args, recording_trainer

SCHEMA = {"type": "object", "required": ["answer"], "properties": {"answer": {"type": "integer"}}}


def chat(text):
    return [{"role": "assistant", "content": text}]


def test_json_schema_reward_by_hand():
    replies = ['{"answer": 12}', '```json\n{"answer": 3}\n```', '{"answer": "12"}', '{"result": 1}', "12", '{"a":']
    assert json_schema_reward(replies, schema=[json.dumps(SCHEMA)] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert json_schema_reward([chat('{"answer": 2.0}')], schema=[SCHEMA]) == [1.0]  # integral float is an integer
    assert not satisfies(True, {"type": "integer"})  # a bool is not a number
    assert satisfies([1, 2], {"type": "array", "items": {"type": "integer"}})
    assert not satisfies([1, "x"], {"type": "array", "items": {"type": "integer"}})
    assert not satisfies("c", {"enum": ["a", "b"]})
    assert parse_json_reply("[" * 100_000) is None  # deep nesting: no RecursionError
    assert "integer" in schema_block(prompt=None, completion="", row={"schema": json.dumps(SCHEMA)}, score=0.0)


def test_reference_reward_by_hand():
    replies = ['{"answer": 12}', "Let me think.\n12.", "twelve", "", '{"answer": "Paris "}', "1,000"]
    references = ["12", "12", "12", "12", "paris", "1000"]
    assert answer_matches_reference(replies, reference=references) == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert extract_answer('{"answer": 7, "why": "x"}') == "7" and extract_answer("a\n\n b \n") == " b"
    assert normalise("12.0") == "12" and normalise(" 0.5! ") == "0.5" and normalise("New   York.") == "new york"
    assert reference_block(prompt=None, completion="", row={"reference": "12"}, score=0.0).endswith("12")


def test_text_rewards_by_hand():
    assert regex_format_reward(["Answer: 12", " Answer: x ", "12"], format_pattern=[r"Answer: \d+"] * 3) == [
        1.0,
        0.0,
        0.0,
    ]
    with pytest.raises(ValueError, match="format_pattern of sample 1"):
        regex_format_reward(["a", "b"], format_pattern=["a", "("])
    assert format_block(prompt=None, completion="", row={"format_pattern": "x+"}, score=0.0).endswith("x+")
    # within budget 1, at 1.5x budget 0.5, at 2x budget 0, empty 0
    assert length_reward(["a b", "a b c", "a b c d", ""], max_words=[2, 2, 2, 2]) == [1.0, 0.5, 0.0, 0.0]
    assert length_reward(["word"]) == [1.0]  # default budget of 50 words


@settings(max_examples=200, deadline=None)
@given(MALFORMED_COMPLETIONS)
def test_example_rewards_never_raise_on_model_output(junk):
    for reward, columns in [
        (json_schema_reward, {"schema": [SCHEMA]}),
        (answer_matches_reference, {"reference": ["12"]}),
        (regex_format_reward, {"format_pattern": [r"\d+"]}),
        (length_reward, {"max_words": [5]}),
    ]:
        (score,) = reward([junk], **columns)
        assert 0.0 <= score <= 1.0


def test_example_rewards_train_with_their_blocks(tiny_model, tiny_tokenizer, tmp_path):
    from datasets import load_dataset

    dataset = load_dataset("json", data_files="reward_funcs/arithmetic.jsonl", split="train")
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[json_schema_reward, answer_matches_reference, length_reward],
        info_blocks=[schema_block, reference_block, None],
        args=make_args(tmp_path, max_completion_length=8),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.replays and all(r["replayed"][:, :2].all() for r in trainer.replays)  # both blocks replayed
    assert not any(r["replayed"][:, 2].any() for r in trainer.replays)  # no block: never replayed
    assert all(torch.isfinite(b["advantages"]).all() for b in trainer.batches)
