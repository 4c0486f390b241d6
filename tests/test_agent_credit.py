"""Token credit on tool-calling rollouts made by TRL's own tool loop: a scripted policy emits a tool call (or answers
at once), TRL parses it with the chat template's response schema, runs the tool (a function, or an environment's
method) and masks its result; MRTPO replays the whole trajectory and places each reward's credit on the model's
tokens only."""

import copy

import pytest
import torch
from datasets import Dataset

from tests.helpers import RecordingTrainer, make_args, observe_term
from tests.reference import reference_process_advantages, reference_step_credit_advantages
from trl_mrtpo.steps.process_rewards import token_positions
from trl_mrtpo.utils import completion_text

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


def call_then_answer(text: str, i: int) -> str:
    """Row i calls ``lookup`` when i is even, and after a tool result answers with a text that varies by row."""
    if "<tool_response>" in text:
        return ANSWERS[i % len(ANSWERS)] + "<|im_end|>\n"
    return TOOL_CALL if i % 2 == 0 else ANSWERS[(i + 1) % len(ANSWERS)] + "<|im_end|>\n"


def scripted_trainer(
    tokenizer, tmp_path, dataset, credit_assignment: str = "mrtpo", reply=call_then_answer, config=None, **inputs
):
    """A recording trainer (MRTPOTrainer, or ResearchTrainer for a research mode) whose policy is scripted:
    ``reply(prompt_text, row)`` is each turn's text (:func:`call_then_answer` by default); everything else (parsing,
    the tool call, masks) is TRL's. ``config``: further ``MRTPOConfig`` fields; ``inputs`` the trainer's (the two
    rewards and their blocks unless given)."""
    from tests.conftest import build_tiny_model
    from tests.helpers import ResearchRecordingTrainer

    fields = dict(max_steps=2, max_completion_length=320, per_device_train_batch_size=4) | (config or {})
    args = make_args(tmp_path, credit_assignment=credit_assignment, **fields)
    base = RecordingTrainer if credit_assignment in ("mrtpo", "gdpo") else ResearchRecordingTrainer

    def scripted_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        replies = [reply(tokenizer.decode(ids), i) for i, ids in enumerate(prompt_ids)]
        return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in replies], None

    class Scripted(base):
        _generate_single_turn = scripted_turn

    rewards = {"reward_funcs": [answered, used_tool], "info_blocks": BLOCKS}
    return Scripted(
        model=build_tiny_model(tokenizer),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
        **(rewards | inputs),
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
        expected = reference_step_credit_advantages(
            credit.rewards.double(),
            credit.relevance,
            credit.mask,
            trainer.reward_weights.double(),
            credit.beta,
            trainer.args.max_second_moment_ratio,
            G=trainer.num_generations,
        )
        assert credit.replayed.any() and credit.beta > 0
        torch.testing.assert_close(credit.advantages.double(), expected, rtol=1e-5, atol=1e-6)


def test_mrtpo_credit_on_trls_tool_loop(tiny_tokenizer, tmp_path):
    tokenizer = tool_tokenizer(tiny_tokenizer)
    trainer = scripted_trainer(tokenizer, tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 8), tools=[lookup])
    trainer.train()
    check_credit_on_model_tokens(trainer)
    # q's logged statistics read each reward's q at the model's tokens by the tool mask (they read the first
    # mask.sum() positions, tool results included and the last turn's tokens left out)
    logged = [entry for entry in trainer.state.log_history if any(k.startswith("mrtpo/q_mean/") for k in entry)]
    assert len(logged) == len(trainer.replays)
    for entry, batch, replay in zip(logged, trainer.batches, trainer.replays):
        mask = (batch["completion_mask"] * batch["tool_mask"]).bool()
        for k, name in enumerate(trainer.reward_func_names):
            rows = replay["replayed"][:, k].nonzero(as_tuple=True)[0].tolist()
            if rows:
                expected = torch.cat([replay["relevance"][i, k][mask[i]] for i in rows]).mean().item()
                assert entry[f"mrtpo/q_mean/{name}"] == pytest.approx(expected, rel=1e-5), name


@pytest.mark.parametrize("source", ["tools", "environment_factory"])
@pytest.mark.parametrize("mode", ["gdpo", "joint", "shuffled", "cort"])
def test_every_other_mode_on_trls_tool_loop(tiny_tokenizer, tmp_path, mode, source):
    """The research room's replaying modes and GDPO on tool rollouts from ``tools`` and from an
    ``environment_factory``: tool results get no advantage, and the replaying modes replay the trajectories."""
    tokenizer = tool_tokenizer(tiny_tokenizer)
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    inputs = {"tools": [lookup]} if source == "tools" else {"environment_factory": Atlas}
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, credit_assignment=mode, **inputs)
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

    trainer = RecordingTrainer(
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


def turn_scores(completions, trajectories, **_):
    """A process reward: each turn of a tool rollout scores (it called a tool) + (it says 42); a completion without
    tool calls is one character span scored by whether it says 42."""
    scored = []
    for completion, view in zip(completions, trajectories):
        if view is None:
            text = completion_text(completion)
            scored.append([(0, len(text), float("42" in text))])
        else:
            scored.append([(turn, float(bool(turn.calls)) + float("42" in turn.text)) for turn in view.turns])
    return scored


def first_turn(*, prompt, completion, row, score, trajectory=None):
    """A failure boundary: the first turn of a tool rollout, the first character of a plain completion."""
    return trajectory.turns[0] if trajectory is not None else 1


def recording_step_rules(trainer, tokenizer) -> list[dict]:
    """Wrap the run's step term: per generation, what it computed (``process``, ``failure_suffix``) and the
    reference's view of the batch, each row's ``(score, last token)`` steps of :func:`turn_scores` and the token of
    :func:`first_turn`'s boundary, placed by hand (a turn ends on its last token)."""
    records = []

    def recording(batch, credit):
        steps, boundaries = [], []
        for view, ids, text, scored in zip(
            batch.views, batch.completion_ids, batch.completions, turn_scores(batch.completions, batch.views)
        ):
            if view is None:
                ((_, end, score),) = scored
                steps.append([(score, token_positions(tokenizer, ids, completion_text(text), [end])[0])])
                boundaries.append(token_positions(tokenizer, ids, completion_text(text), [1])[0])
            else:
                steps.append([(score, turn.tokens[1] - 1) for turn, score in scored])
                boundaries.append(view.turns[0].tokens[1] - 1)
        records.append(
            {
                "process": credit.process,
                "failure_suffix": credit.failure_suffix,
                "steps": steps,
                "boundaries": boundaries,
                "views": batch.views,
            }
        )

    observe_term(trainer.credit_terms["process"], recording)
    return records


def reference_suffix(boundaries, group_advantages, reward_weights, width) -> torch.Tensor:
    """``[B, K, C]``: the positions after each row's boundary, for the rewards whose credit is negative."""
    negative = group_advantages.double() * reward_weights.double() < 0
    suffix = torch.zeros((*negative.shape, width), dtype=torch.bool)
    for j, boundary in enumerate(boundaries):
        suffix[j, :, boundary + 1 :] = negative[j][:, None]
    return suffix


@pytest.mark.parametrize("mode", ["mrtpo", "gdpo"])
def test_per_turn_process_rewards_and_failure_turns_on_trls_tool_loop(tiny_tokenizer, tmp_path, mode):
    """A process reward scores each turn of a tool rollout (its score ends on the turn's last token) and character
    spans of a completion without tool calls; a failure boundary returns the first turn. The advantages equal the
    float64 reference of steps 1-8 with the process advantages and the dropped penalties, on the model's tokens."""
    tokenizer = tool_tokenizer(tiny_tokenizer)
    trainer = scripted_trainer(
        tokenizer,
        tmp_path,
        Dataset.from_list([{"prompt": QUESTION}] * 8),
        credit_assignment=mode,
        tools=[lookup],
        process_rewards=[turn_scores],
        failure_boundaries=[first_turn, first_turn],
    )
    records = recording_step_rules(trainer, tokenizer)
    trainer.train()
    assert len(records) == len(trainer.credits) == 2
    for credit, batch, record in zip(trainer.credits, trainer.batches, records):
        assert any(view is not None for view in record["views"]) and any(view is None for view in record["views"])
        width = credit.mask.shape[1]
        process = reference_process_advantages(record["steps"], trainer.num_generations, width)
        suffix = reference_suffix(record["boundaries"], credit.group_advantages, trainer.reward_weights, width)
        assert process.abs().max() > 0 and (suffix & credit.mask.bool()[:, None]).any()
        expected = reference_step_credit_advantages(
            credit.rewards.double(),
            credit.relevance,
            credit.mask,
            trainer.reward_weights.double(),
            credit.reward_betas.double(),
            trainer.args.max_second_moment_ratio,
            G=trainer.num_generations,
            process=process,
            suffix=suffix,
        )
        assert credit.replayed.any() == (mode == "mrtpo")
        assert (credit.advantages[credit.mask == 0] == 0).all() and (batch["tool_mask"] == 0).any()
        torch.testing.assert_close(credit.advantages.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_tool_rollouts_on_two_processes(tmp_path):
    """DDP over two CPU processes, with a per-turn process reward and failure turns: each rank's process advantages
    are the float64 reference's over both ranks' step scores (a group's statistics see all its responses), its
    failure suffixes the reference's, and its token advantages equal one process's on the merged batch, 0 on tool
    results."""
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
        width = max(part["mask"].shape[1] for part in parts)
        steps = [row for part in parts for row in part["steps"]]
        process = reference_process_advantages(steps, 8, width)  # one group of 8 over both ranks
        assert process.abs().max() > 0
        offset = 0
        for part in parts:
            assert (part["tool_mask"] == 0).any()
            assert (part["advantages"][part["mask"] == 0] == 0).all()
            rows, local_width = part["process"].shape
            torch.testing.assert_close(
                part["process"], process[offset : offset + rows, :local_width].to(part["process"])
            )
            suffix = reference_suffix(
                part["boundaries"], part["group_advantages"], part["reward_weights"], local_width
            )
            assert torch.equal(part["failure_suffix"].cpu(), suffix)
            offset += rows
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
        step_two, context_ids, completion_ids = replay_inputs(batch, joint)
        recorded.append((context_ids, completion_ids, batch.mask))
        return step_two, context_ids, completion_ids

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


LIST_RESULTS = {
    "values": (lambda city: [city, 42], r"\['Paris', 42\]"),
    "empty": (lambda city: [], r"\[\]"),
    "records": (lambda city: [{"type": "record", "city": city}], r"\[\{'type': 'record'"),
    "text parts": (lambda city: [{"type": "text", "text": city}], r"\[\{'type': 'text'"),
}


@pytest.mark.parametrize("result", list(LIST_RESULTS))
@pytest.mark.parametrize("mode", ["mrtpo", "gdpo"])  # gdpo here builds no trajectory view: checked all the same
def test_a_tool_returning_a_list_is_named(tiny_tokenizer, tmp_path, mode, result):
    """TRL passes a list result through as multimodal content parts, which a text model's template renders as an
    empty tool response (an empty list and well-formed text parts too): the model would read nothing where the result
    should be, and the view would disagree with the tokens. Refused, naming the tool and the sample."""
    value, shown = LIST_RESULTS[result]

    def lookup(city: str) -> list:
        """Look up the code of a city.

        Args:
            city: the city's name.
        """
        return value(city)

    tokenizer = tool_tokenizer(tiny_tokenizer)
    dataset = Dataset.from_list([{"prompt": QUESTION}] * 8)
    trainer = scripted_trainer(tokenizer, tmp_path, dataset, credit_assignment=mode, tools=[lookup])
    with pytest.raises(ValueError, match=f"Tool 'lookup' returned the list {shown}.* on sample 0: .*Return a string"):
        trainer.train()
