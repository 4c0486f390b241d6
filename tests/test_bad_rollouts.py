"""Bad rollouts: environments, tools and rollout functions in forms TRL cannot train on, tool-call iterations and
environment masks; each is refused naming the argument, the environment or the completion."""

import pytest
import torch


@pytest.mark.parametrize("iterations", [-1, 2.5, "2", True, float("nan")])
def test_max_tool_calling_iterations_is_checked_at_start_up(iterations, tmp_path):
    """TRL passes it through unchecked (-1 ran no tool at all, 2.5 ran three rounds)."""
    from trl_mrtpo import MRTPOConfig

    with pytest.raises(ValueError, match=r"max_tool_calling_iterations must be None \(no limit\) or an integer >= 0"):
        MRTPOConfig(output_dir=str(tmp_path), max_tool_calling_iterations=iterations, use_cpu=True, bf16=False)
    assert MRTPOConfig(output_dir=str(tmp_path), max_tool_calling_iterations=0, use_cpu=True, bf16=False)


class ScoresWithThePolicy:
    """A reward that runs the policy, saying so on its class (as MathShepherd does)."""

    runs_policy_forwards = True
    __name__ = "scores_with_the_policy"

    def __call__(self, completions, **kwargs):
        return [0.0] * len(completions)


@pytest.mark.parametrize("engine", ["DeepSpeed ZeRO-3", "FSDP2"])
def test_a_class_level_runs_policy_forwards_is_seen_under_sharding(engine, tiny_model, tiny_tokenizer, tmp_path):
    """The refusal read the flag after the reward check had wrapped the function (which copies only the instance's
    attributes): a reward that runs the policy trained under ZeRO-3 / FSDP, where its forwards can deadlock."""
    from unittest.mock import patch

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    with patch("trl_mrtpo._trl.sharding_engine", lambda trainer: engine):
        with pytest.raises(ValueError, match=f"'scores_with_the_policy' run the policy .* {engine} does not support"):
            MRTPOTrainer(
                model=tiny_model,
                reward_funcs=[*BASIC.rewards, ScoresWithThePolicy()],
                info_blocks=[*BASIC.info_blocks, None],
                args=make_args(tmp_path, credit_assignment="gdpo"),
                train_dataset=make_basic_dataset(4),
                processing_class=tiny_tokenizer,
            )


def _ids_and_masks(kind: str):
    import numpy

    ids = [[5, 6, 7], [8, 9, 10]]
    masks = [[1, 0, 1], [1, 1, 0]]
    return {
        "padded ids tensor": (torch.tensor(ids), masks),
        "mask rows numpy": (ids, [numpy.array(m) for m in masks]),
        "mask rows tensors": (ids, [torch.tensor(m) for m in masks]),
        "mask 2-D tensor": (ids, torch.tensor(masks)),
        "mask bool numpy": (ids, numpy.array(masks, dtype=bool)),
    }[kind]


@pytest.mark.parametrize(
    "kind", ["padded ids tensor", "mask rows numpy", "mask rows tensors", "mask 2-D tensor", "mask bool numpy"]
)
def test_a_rollouts_env_mask_in_array_form_is_read_as_trl_reads_it(kind):
    """Item 11: TRL accepts completion ids as one padded tensor and env_mask rows as arrays or tensors; the rollout
    check crashed on the first and refused the others ("found ndarray: None")."""
    from trl_mrtpo.checks.environments import checked_rollout

    ids, masks = _ids_and_masks(kind)
    output = {"prompt_ids": [[1], [1]], "completion_ids": ids, "logprobs": None, "env_mask": masks}
    assert checked_rollout(lambda prompts, trainer: output)(["p", "q"], None) is output


def test_an_array_env_mask_of_the_wrong_length_is_refused_naming_the_completion():
    import numpy

    from trl_mrtpo.checks.environments import checked_rollout

    def rollout(prompts, trainer):
        return {"completion_ids": [[5, 6, 7], [8, 9]], "env_mask": [numpy.array([1, 0, 1]), numpy.array([1])]}

    with pytest.raises(ValueError, match=r"env_mask for completion 1 .* 2 completion ids \(found 1 entries: \[1\]\)"):
        checked_rollout(rollout)(["p", "q"], None)


ROLLOUT_OUTPUTS = {
    "a list": (lambda prompts: [[5, 6]] * len(prompts), TypeError, "returned list; it must return a dict"),
    "one completion fewer": (
        lambda prompts: {
            "prompt_ids": [[1]] * len(prompts),
            "completion_ids": [[5]] * (len(prompts) - 1),
            "logprobs": None,
        },
        ValueError,
        "returned 1 completions for the 2 prompts it was given",
    ),
}


@pytest.mark.parametrize("case", list(ROLLOUT_OUTPUTS), ids=list(ROLLOUT_OUTPUTS))
def test_a_rollout_output_trl_cannot_train_on_is_refused_naming_the_rollout(case):
    """Item 14: TRL blamed the first reward for a missing completion and failed on `.keys()` of a list."""
    from trl_mrtpo.checks.environments import checked_rollout

    make, error, message = ROLLOUT_OUTPUTS[case]

    def my_rollout(prompts, trainer):
        return make(prompts)

    with pytest.raises(error, match=f"rollout_func 'my_rollout' {message}"):
        checked_rollout(my_rollout)(["p", "q"], None)


class _Shop:
    def reset(self, **row):
        return None

    def look(self) -> str:
        """Look around."""
        return "shelves"


@pytest.mark.parametrize(
    "argument,value,message",
    [
        ("environment_factory", _Shop(), "environment_factory is an instance of _Shop; pass the class"),
        ("environment_factory", {"shop": _Shop()}, r"environment_factory\['shop'\] is an instance of _Shop"),
        ("tools", ["look"], "tools\\[0\\] is str 'look'; a tool is a function"),
    ],
    ids=["factory instance", "factory dict of instances", "tool name"],
)
def test_an_environment_or_tool_given_in_the_wrong_form_is_refused_naming_the_argument(
    argument, value, message, tiny_model, tiny_tokenizer, tmp_path
):
    """Item 14: TRL failed on ``factory()`` ("object is not callable") or deep in the tool schema."""
    from tests.helpers import make_args, make_basic_dataset
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits import get_kit

    basic = get_kit("basic")
    with pytest.raises(TypeError, match=message):
        MRTPOTrainer(
            model=tiny_model, reward_funcs=basic.rewards, args=make_args(tmp_path),
            train_dataset=make_basic_dataset(4), processing_class=tiny_tokenizer, **{argument: value},
        )  # fmt: skip


@pytest.mark.parametrize(
    "observation", [{"text": "hi"}, 3, [{"type": "text", "text": "hi"}]], ids=["dict", "int", "parts"]
)
def test_a_reset_returning_what_a_text_model_cannot_read_is_refused_naming_the_environment(
    observation, tiny_tokenizer, tmp_path
):
    """TRL appends ``reset()``'s return to the prompt: ``str + dict`` failed inside TRL, and content parts rendered
    as nothing for a text model. Both stop the first step naming the environment's class and what it returned, read
    from the batch TRL builds (the environment itself is not wrapped)."""
    from datasets import Dataset

    from tests.test_agent_credit import QUESTION, Atlas, scripted_trainer, tool_tokenizer

    class Desk(Atlas):
        def reset(self, **row):
            return observation

    dataset = Dataset.from_list([{"prompt": QUESTION}] * 4)
    trainer = scripted_trainer(tool_tokenizer(tiny_tokenizer), tmp_path, dataset, environment_factory=Desk)
    with pytest.raises(TypeError, match=rf"Desk.reset\(\) returned {type(observation).__name__}"):
        trainer.train()


def test_nothing_the_user_passed_is_patched(tiny_tokenizer, tmp_path):
    """The user's reward list, reward objects, environment class and the environments TRL builds from it are as they
    were: MRTPO checks what they return where it enters, without wrapping them after construction."""
    from datasets import Dataset

    from tests.test_agent_credit import QUESTION, Atlas, answered, scripted_trainer, tool_tokenizer

    class Scorer:
        def __init__(self):
            self.calls = 0

        def __call__(self, completions, **kwargs):
            self.calls += 1
            return [1.0] * len(completions)

    scorer = Scorer()
    rewards = [answered, scorer]

    def members(cls):  # reading a class's __annotations__ creates it: only its own names count
        return {name: value for name, value in vars(cls).items() if not name.startswith("__")}

    before = (list(rewards), dict(vars(scorer)), members(Atlas))
    trainer = scripted_trainer(tool_tokenizer(tiny_tokenizer), tmp_path, Dataset.from_list([{"prompt": QUESTION}] * 4),
                               reward_funcs=rewards, environment_factory=Atlas)  # fmt: skip
    assert (rewards, dict(vars(scorer)), members(Atlas)) == before
    assert trainer.environment_factories == {None: Atlas}
    trainer.train()
    assert scorer.calls > 0 and rewards == before[0]
    for environment in trainer._environment_pool[None]:
        assert type(environment) is Atlas and "reset" not in vars(environment)
