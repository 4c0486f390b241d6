"""Bad data: prompts, messages and datasets a user may hand the trainer, each refused naming the split and the row."""

import pytest
from datasets import Dataset, IterableDataset

from tests.helpers import make_args
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.checks.inputs import check_dataset
from trl_mrtpo.kits.basic import KIT as BASIC


# ---------------------------------------------------------------- prompts and datasets, before the first step
@pytest.mark.parametrize(
    "prompts, message",
    [
        (["Say hi.", ""], "prompt of row 1 of the train dataset is an empty string"),
        (["   "], "prompt of row 0 of the train dataset is an empty string"),
        ([[{"role": "user", "content": "hi"}], []], "row 1 of the train dataset is an empty list"),
        ([[{"content": "no role"}]], "message 0 of the prompt of row 0 .* not a dict with 'role' and 'content'"),
        ([["just text"]], "message 0 of the prompt of row 0"),
    ],
)
def test_malformed_prompts_name_the_row(prompts, message):
    with pytest.raises(ValueError, match=message):
        check_dataset(Dataset.from_dict({"prompt": prompts}), "train")


def test_none_and_numeric_prompts_name_the_row():
    with pytest.raises(ValueError, match="row 2 of the eval dataset is a NoneType"):
        check_dataset([{"prompt": "a"}, {"prompt": "b"}, {"prompt": None}], "eval")
    with pytest.raises(ValueError, match="row 0 of the eval dataset is a int"):
        check_dataset([{"prompt": 5}], "eval")


def test_dataset_without_prompt_column():
    with pytest.raises(ValueError, match="train dataset has no 'prompt' column \\(columns: question, answer\\)"):
        check_dataset(Dataset.from_dict({"question": ["q"], "answer": ["a"]}), "train")


def test_streaming_and_dict_datasets():
    stream = IterableDataset.from_generator(lambda: iter([{"text": "x"}]))
    with pytest.raises(ValueError, match="has no 'prompt' column"):
        check_dataset(stream, "train")
    check_dataset(IterableDataset.from_generator(lambda: iter([{"prompt": "x"}])), "train")  # fine
    with pytest.raises(ValueError, match="eval 'b' dataset"):
        check_dataset({"a": Dataset.from_dict({"prompt": ["x"]}), "b": Dataset.from_dict({"prompt": [""]})}, "eval")


def test_trainer_checks_the_dataset_at_init(tiny_model, tiny_tokenizer, tmp_path):

    with pytest.raises(ValueError, match="row 3 of the train dataset is an empty string"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            args=make_args(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a", "b", "c", ""]}),
            processing_class=tiny_tokenizer,
        )


# ---------------------------------------------------------------- chat messages and spans
@pytest.mark.parametrize("content", [None, 3, ["text"]])
def test_a_message_content_that_is_not_text_names_the_row(content):
    rows = [{"prompt": [{"role": "user", "content": "ok"}]}, {"prompt": [{"role": "user", "content": content}]}]
    with pytest.raises(ValueError, match="message 0 of the prompt of row 1 of the train dataset has content"):
        check_dataset(rows, "train")


def test_content_none_beside_tool_calls_and_typed_parts_pass():
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    prompt = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    check_dataset([{"prompt": prompt}], "train")
