"""Token credit on tool-calling rollouts made by TRL's own tool loop: a scripted policy emits a tool call (or answers
at once), TRL parses it with the chat template's response schema, runs the tool (a function, or an environment's
method) and masks its result; MRTPO replays the whole trajectory and places each reward's credit on the model's
tokens only."""

import copy

import pytest
import torch
from datasets import Dataset

from tests.helpers import RecordingTrainer, make_args
from tests.reference import reference_token_advantages

TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
ANSWERS = ["The code is 42.", "I do not know.", "It is 42, I think.", "No idea."]
QUESTION = [{"role": "user", "content": "What is the code of Paris?"}]


def lookup(city: str) -> str:
    """Look up the code of a city.

    Args:
        city: the city's name.
    """
    return f"The code of {city} is 42."


class Atlas:
    """An environment whose one tool is ``lookup``."""

    def reset(self, **kwargs):
        return None

    def lookup(self, city: str) -> str:
        """Look up the code of a city.

        Args:
            city: the city's name.
        """
        return f"The code of {city} is 42."


def answered(completions, **_):
    return [float("42" in completion[-1]["content"]) for completion in completions]


def used_tool(completions, **_):
    return [float(any(message.get("tool_calls") for message in completion)) for completion in completions]


BLOCKS = [lambda **_: "The code of Paris is 42.", lambda **_: "Call the lookup tool first."]


def tool_tokenizer(tiny_tokenizer):
    from trl.chat_template_utils import add_response_schema, qwen3_chat_template

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.chat_template = qwen3_chat_template
    return add_response_schema(tokenizer)


def scripted_trainer(tokenizer, tmp_path, dataset, credit_assignment: str = "mrtpo", **tool_source):
    """A recording trainer (MRTPOTrainer, or ResearchTrainer for a research mode) whose policy is scripted: row i
    calls ``lookup`` when i is even, and after a tool result answers with a text that varies by row; everything else
    (parsing, the tool call, masks) is TRL's."""
    from tests.conftest import build_tiny_model
    from tests.helpers import ResearchRecordingTrainer

    args = make_args(
        tmp_path,
        max_steps=2,
        max_completion_length=320,
        per_device_train_batch_size=4,
        credit_assignment=credit_assignment,
    )
    base = RecordingTrainer if credit_assignment in ("mrtpo", "gdpo") else ResearchRecordingTrainer

    def scripted_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        completions = []
        for i, ids in enumerate(prompt_ids):
            if "<tool_response>" in tokenizer.decode(ids):
                reply = ANSWERS[i % len(ANSWERS)] + "<|im_end|>\n"
            else:
                reply = TOOL_CALL if i % 2 == 0 else ANSWERS[(i + 1) % len(ANSWERS)] + "<|im_end|>\n"
            completions.append(tokenizer(reply, add_special_tokens=False)["input_ids"])
        return completions, None

    class Scripted(base):
        _generate_single_turn = scripted_turn

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.credits = [*getattr(self, "credits", []), self.last_credit]
            return output

    return Scripted(
        model=build_tiny_model(tokenizer),
        reward_funcs=[answered, used_tool],
        info_blocks=BLOCKS,
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **tool_source,
    )


def check_credit_on_model_tokens(trainer) -> None:
    """Tool results masked by TRL carry no q and no advantage; the advantages equal the float64 reference computed
    on each row's model tokens gathered into a prefix (the tool results take no part in any mean, cap or std)."""
    for batch, replay in zip(trainer.batches, trainer.replays):
        assert (batch["tool_mask"] == 0).any()  # TRL ran the tool and masked its result
        mask = batch["completion_mask"] * batch["tool_mask"]
        relevance = replay["relevance"]
        assert replay["replayed"].any()
        assert (relevance[(mask == 0)[:, None, :].expand_as(relevance)] == 0).all()
        assert (batch["advantages"][mask == 0] == 0).all()
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


def test_mrtpo_credit_on_trls_tool_loop(tiny_tokenizer, tmp_path):
    tokenizer = tool_tokenizer(tiny_tokenizer)
    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8), tools=[lookup])
    trainer.train()
    check_credit_on_model_tokens(trainer)


@pytest.mark.parametrize("mode", ["gdpo", "joint", "shuffled", "cort"])
def test_every_other_mode_on_trls_tool_loop(tiny_tokenizer, tmp_path, mode):
    """The research room's replaying modes and GDPO on tool rollouts: tool results get no advantage, and the
    replaying modes replay the trajectories."""
    tokenizer = tool_tokenizer(tiny_tokenizer)
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, credit_assignment=mode, tools=[lookup])
    trainer.train()
    for batch, replay in zip(trainer.batches, trainer.replays):
        mask = batch["completion_mask"] * batch["tool_mask"]
        assert (batch["tool_mask"] == 0).any() and (batch["advantages"][mask == 0] == 0).all()
        assert replay["replayed"].any() == (mode != "gdpo")


@pytest.mark.parametrize("several", [False, True], ids=["one environment", "a dict of environments"])
def test_mrtpo_credit_with_an_environment_factory(tiny_tokenizer, tmp_path, several):
    tokenizer = tool_tokenizer(tiny_tokenizer)
    if several:  # each example names its environment; both expose the same tool here
        factory = {"atlas": Atlas, "gazetteer": type("Gazetteer", (Atlas,), {})}
        rows = [{"prompt": QUESTION, "environment": name} for name in ("atlas", "gazetteer")] * 4
    else:
        factory, rows = Atlas, [{"prompt": QUESTION}] * 8
    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list(rows), environment_factory=factory)
    trainer.train()
    check_credit_on_model_tokens(trainer)


def test_mrtpo_credit_with_a_rollout_func_and_its_env_mask(tiny_tokenizer, tmp_path):
    """A custom rollout returns the ids and an ``env_mask`` (0 on what the environment wrote): MRTPO reads it as
    TRL does, so the environment's tokens carry no q and no advantage."""
    from tests.conftest import build_tiny_model

    tokenizer = tool_tokenizer(tiny_tokenizer)

    def rollout(prompts, trainer):
        encode = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
        prompt_ids = [
            tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
            for p in prompts
        ]
        completion_ids, env_mask = [], []
        for i in range(len(prompts)):
            own, observed, answer = encode("Let me look."), encode(" [atlas: Paris is 42] "), encode(ANSWERS[i % 4])
            completion_ids.append(own + observed + answer + encode("<|im_end|>\n"))
            env_mask.append(
                [1] * len(own) + [0] * len(observed) + [1] * (len(completion_ids[-1]) - len(own) - len(observed))
            )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None, "env_mask": env_mask}

    class Recorded(RecordingTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self.credits = [*getattr(self, "credits", []), self.last_credit]
            return output

    trainer = Recorded(
        model=build_tiny_model(tokenizer),
        reward_funcs=[answered, used_tool],
        info_blocks=BLOCKS,
        rollout_func=rollout,
        args=make_args(tmp_path, max_steps=2, max_completion_length=320, per_device_train_batch_size=4),
        train_dataset=Dataset.from_list([{"prompt": QUESTION}] * 8),
        processing_class=tokenizer,
    )
    trainer.train()
    check_credit_on_model_tokens(trainer)


@pytest.mark.slow
def test_tool_rollouts_on_two_processes(tmp_path):
    """DDP over two CPU processes: each rank's token advantages on its tool rollouts equal one process's on the
    merged batch, and stay 0 on tool results."""
    import os
    import subprocess
    import sys

    from tests.helpers import check_merged_advantages
    from tests.test_ddp import DISTRIBUTED_VARIABLES

    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "recipes/accelerate/cpu_ddp.yaml",
        "--main_process_port", "0",
        "tests/agent_worker.py", str(tmp_path),
    ]  # fmt: skip
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    assert result.returncode == 0, result.stderr[-8000:]
    for generation in (0, 1):
        parts = [torch.load(tmp_path / f"rank{rank}_generation{generation}.pt") for rank in (0, 1)]
        for part in parts:
            assert (part["tool_mask"] == 0).any()
            assert (part["advantages"][part["mask"] == 0] == 0).all()
        check_merged_advantages(parts)


def test_the_replay_of_trajectories_computes_the_closed_form_minimum(tiny_tokenizer, tmp_path, monkeypatch):
    """On the tool loop's trajectories (tool results inside the completions) the prefix-tree replay computes each
    distinct context prefix once, then the last context token and the completion of every sequence."""
    from tests.test_replay import decoder_tokens

    tokenizer = tool_tokenizer(tiny_tokenizer)
    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8), tools=[lookup])
    recorded = []
    replay_inputs = trainer._replay_inputs

    def recording(batch, joint):
        wanted, context_ids, completion_ids = replay_inputs(batch, joint)
        recorded.append((context_ids, completion_ids, batch.mask))
        return wanted, context_ids, completion_ids

    trainer._replay_inputs = recording
    trainer.train()
    context_ids, completion_ids, mask = recorded[0]
    kept = [i for i, contexts in enumerate(context_ids) if len(contexts) >= 2]
    contexts, completions = [context_ids[i] for i in kept], [completion_ids[i] for i in kept]
    assert any((mask[i, : len(completion_ids[i])] == 0).any() for i in kept)  # tool results among them
    sequences = [(c, completion) for ctx, completion in zip(contexts, completions) for c in ctx]
    distinct = {tuple(c[:n]) for c, _ in sequences for n in range(1, len(c))}
    minimum = len(distinct) + sum(1 + len(completion) for _, completion in sequences)
    model = trainer.accelerator.unwrap_model(trainer.model)
    assert decoder_tokens(model, contexts, completions, 1, monkeypatch) == minimum


def test_the_trajectory_view_by_hand():
    from trl_mrtpo.trajectories import trajectory

    call = {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oz"}}}
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "name": "lookup", "content": "{'error': 'Oz is not a city'}"},
        {"role": "tool", "name": "lookup", "content": "{'error': __import__('os')}"},  # never evaluated
        {"role": "assistant", "content": "Sorry."},
    ]
    view = trajectory(messages, [1, 1, 1, 0, 0, 0, 1, 1])
    assert [t.tokens for t in view.turns] == [(0, 3), (6, 8)] and view.results == ((3, 6),)
    first, second = view.turns[0].calls
    assert (first.name, first.arguments, first.error) == ("lookup", {"city": "Oz"}, "Oz is not a city")
    assert second.error is None and second.result == "{'error': __import__('os')}"
    assert view.failed == [first] and view.turns[1].text == "Sorry." and view.turns[1].calls == ()
    assert trajectory("plain text", [1, 1]) is None
    assert trajectory([{"role": "assistant", "content": "hi"}], [1]) is None


def test_builders_see_the_tool_calls_their_results_and_errors(tiny_tokenizer, tmp_path):
    """A builder that takes ``trajectory`` reads the calls TRL ran (arguments, result, error) and the token ranges
    of the turns; a builder with the four plain fields keeps working beside it."""

    def failing_lookup(city: str) -> str:
        """Look up the code of a city.

        Args:
            city: the city's name.
        """
        raise KeyError(city)

    failing_lookup.__name__ = "lookup"
    tokenizer = tool_tokenizer(tiny_tokenizer)
    trainer = scripted_trainer(
        tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8), tools=[failing_lookup]
    )
    seen = []

    def feedback(*, prompt, completion, row, score, trajectory):
        seen.append(trajectory)
        if trajectory is None or not trajectory.failed:
            return "Answer with the code."
        return f"The call {trajectory.failed[0].name} failed with: {trajectory.failed[0].error}"

    trainer.info_block_builders = [feedback, BLOCKS[1]]
    trainer.train()
    views = [view for view in seen if view is not None]
    assert views and len(views) < len(seen)  # odd rows answer without a tool: no view
    for view in views:
        (call,) = view.calls
        assert (call.name, call.arguments, call.error) == ("lookup", {"city": "Paris"}, "'Paris'")
        assert len(view.turns) == 2 and view.turns[0].tokens[1] == view.results[0][0]
    assert all(replay["replayed"].any() for replay in trainer.replays)


def test_a_tool_returning_a_non_string_is_read_as_trl_wrote_it(tiny_tokenizer, tmp_path):
    """TRL converts a non-string result with ``str``; the trajectory view reads that text (not an error) and the
    credit stays exact on the model's tokens."""

    def lookup(city: str) -> dict:
        """Look up the code of a city.

        Args:
            city: the city's name.
        """
        return {"city": city, "code": 42}

    tokenizer = tool_tokenizer(tiny_tokenizer)
    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8), tools=[lookup])
    seen = []

    def feedback(*, prompt, completion, row, score, trajectory):
        seen.append(trajectory)
        return "Answer with the code."

    trainer.info_block_builders = [feedback, BLOCKS[1]]
    trainer.train()
    calls = [call for view in seen if view is not None for call in view.calls]
    assert calls and all(c.result == "{'city': 'Paris', 'code': 42}" and c.error is None for c in calls)
    check_credit_on_model_tokens(trainer)
