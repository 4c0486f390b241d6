"""Token credit on tool-calling rollouts made by TRL's own tool loop: a scripted policy emits a tool call (or answers
at once), TRL parses it with the chat template's response schema, runs the tool and masks its result; MRTPO replays
the whole trajectory and places each reward's credit on the model's tokens only."""

import copy

import torch

from tests.helpers import RecordingTrainer, make_args
from tests.reference import reference_token_advantages

TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'


def lookup(city: str) -> str:
    """Look up the code of a city.

    Args:
        city: the city's name.
    """
    return f"The code of {city} is 42."


def answered(completions, **_):
    return [float("42" in completion[-1]["content"]) for completion in completions]


def used_tool(completions, **_):
    return [float(any(message.get("tool_calls") for message in completion)) for completion in completions]


def tool_tokenizer(tiny_tokenizer):
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = qwen3_chat_template
    return add_response_schema(tokenizer)


def test_mrtpo_credit_on_trls_tool_loop(tiny_tokenizer, tmp_path):
    from tests.conftest import build_tiny_model

    tokenizer = tool_tokenizer(tiny_tokenizer)
    model = build_tiny_model(tokenizer)
    answers = ["The code is 42.", "I do not know.", "It is 42, I think.", "No idea."]

    def scripted_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Row i calls the tool when i is even; after a tool result, an answer that varies by row."""
        completions = []
        for i, ids in enumerate(prompt_ids):
            text = tokenizer.decode(ids)
            if "<tool_response>" in text:
                reply = answers[i % len(answers)] + "<|im_end|>\n"
            else:
                reply = TOOL_CALL if i % 2 == 0 else answers[(i + 1) % len(answers)] + "<|im_end|>\n"
            completions.append(tokenizer(reply, add_special_tokens=False)["input_ids"])
        return completions, None

    class Scripted(RecordingTrainer):
        _generate_single_turn = scripted_turn

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.credits = [*getattr(self, "credits", []), self.last_credit]
            return output

    from datasets import Dataset

    trainer = Scripted(
        model=model,
        reward_funcs=[answered, used_tool],
        info_blocks=[lambda **_: "The code of Paris is 42.", lambda **_: "Call the lookup tool first."],
        tools=[lookup],
        args=make_args(tmp_path, max_steps=2, max_completion_length=320, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": "What is the code of Paris?"}]}] * 8),
        processing_class=tokenizer,
    )
    trainer.train()
    for batch, replay in zip(trainer.batches, trainer.replays):
        tool_mask = batch["tool_mask"]
        assert (tool_mask == 0).any()  # TRL ran the tool and masked its result
        mask = batch["completion_mask"] * tool_mask
        relevance = replay["relevance"]
        assert replay["replayed"].any()
        assert (relevance[(mask == 0)[:, None, :].expand_as(relevance)] == 0).all()  # no q on tool results
        assert (batch["advantages"][mask == 0] == 0).all()
    # The float64 reference on the model's tokens alone (each row's unmasked positions gathered into a prefix), put
    # back at their positions: the tool results take no part in any mean, cap or std.
    for credit in trainer.credits:
        positions = [row.nonzero().flatten() for row in credit.mask]
        n, k, width = credit.relevance.shape
        compact_q = torch.zeros(n, k, width, dtype=torch.float64)
        compact_mask = torch.zeros(n, width)
        for j, where in enumerate(positions):
            compact_q[j, :, : len(where)] = credit.relevance[j][:, where].double()
            compact_mask[j, : len(where)] = 1
        compact, _ = reference_token_advantages(
            credit.rewards.double(),
            compact_q,
            compact_mask,
            trainer.reward_weights.double(),
            credit.beta,
            trainer.args.max_second_moment_ratio,
            G=trainer.num_generations,
        )
        expected = torch.zeros(credit.mask.shape, dtype=torch.float64)
        for j, where in enumerate(positions):
            expected[j, where] = compact[j, : len(where)]
        assert credit.replayed.any() and credit.beta > 0
        torch.testing.assert_close(credit.advantages.double(), expected, rtol=1e-5, atol=1e-6)


def test_environment_factory_is_refused_with_a_replaying_mode(tiny_tokenizer, tmp_path):
    import pytest

    from tests.conftest import build_tiny_model
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    class Lookup:
        def reset(self, **kwargs):
            return None

        def lookup(self, city: str) -> str:
            """Look up the code of a city.

            Args:
                city: the city's name.
            """
            return "42"

    tokenizer = tool_tokenizer(tiny_tokenizer)
    with pytest.raises(ValueError, match="with `environment_factory` it is not tested yet"):
        MRTPOTrainer(
            model=build_tiny_model(tokenizer),
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            environment_factory=Lookup,
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(4),
            processing_class=tokenizer,
        )
