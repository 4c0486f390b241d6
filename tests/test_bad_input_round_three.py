"""Round three of bad input: the surfaces added since round two, tried as a new user would. Each case ends in a clear
error naming what is wrong, before any model is loaded or any step runs."""

import pytest
import torch

from trl_mrtpo.scripts.cli import main

# every count flag of the CLI's verbs: a value below its minimum is refused by argparse, naming the flag (`demo
# --steps 0` trained one step and saved an adapter; `--steps -1` trained 12)
COUNT_FLAGS = [
    (["demo", "--steps", "0"], "--steps", ">= 1"),
    (["demo", "--steps", "-1"], "--steps", ">= 1"),
    (["demo", "--prompts-per-step", "0"], "--prompts-per-step", ">= 1"),
    (["demo", "--max-completion-length", "0"], "--max-completion-length", ">= 1"),
    (["demo", "--num-generations", "1"], "--num-generations", ">= 2"),
    (["demo", "--warmup-steps", "-3"], "--warmup-steps", ">= 0"),
    (["demo", "--threads", "0"], "--threads", ">= 1"),
    (["inspect", "--num-prompts", "0"], "--num-prompts", ">= 1"),
    (["inspect", "--num-generations", "0"], "--num-generations", ">= 2"),
    (["inspect", "--max-new-tokens", "0"], "--max-new-tokens", ">= 1"),
    (["eval", "--limit", "0"], "--limit", ">= 1"),
    (["eval", "--batch-size", "2.5"], "--batch-size", ">= 1"),
    (["gym", "--jobs", "0"], "--jobs", ">= 1"),
]


@pytest.mark.parametrize("argv,flag,minimum", COUNT_FLAGS, ids=[" ".join(a) for a, _, _ in COUNT_FLAGS])
def test_a_count_flag_below_its_minimum_is_refused_naming_the_flag(argv, flag, minimum, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}: must be an integer {minimum}, got {argv[-1]!r}" in error, error


# trajectory views: builders share them, so they are read-only all the way down (one builder's edit reached the next
# builder's view), and hashable (Turn and ToolCall as dict keys raised "unhashable type: 'dict'")
VIEW_EDITS = [
    ("set", lambda call: call.arguments.__setitem__("city", "Rome")),
    ("delete", lambda call: call.arguments.pop("city")),
    ("update", lambda call: call.arguments.update(city="Rome")),
    ("nested list", lambda call: call.arguments["stops"].append("Rome")),
    ("nested dict", lambda call: call.arguments["options"].__setitem__("fast", False)),
]


def _view():
    from trl_mrtpo.trajectories import trajectory

    arguments = {"city": "Oslo", "stops": ["Bergen"], "options": {"fast": True}}
    messages = [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "go", "arguments": arguments}}]},
        {"role": "tool", "content": "ok"},
        {"role": "assistant", "content": "done"},
    ]
    return trajectory(messages, [1, 1, 0, 1]), arguments


@pytest.mark.parametrize("edit", [e for _, e in VIEW_EDITS], ids=[name for name, _ in VIEW_EDITS])
def test_a_builder_cannot_edit_the_trajectory_view_the_next_builder_reads(edit):
    view, original = _view()
    (call,) = view.calls
    with pytest.raises((TypeError, AttributeError)):
        edit(call)
    assert call.arguments == {"city": "Oslo", "stops": ("Bergen",), "options": {"fast": True}}
    assert original == {"city": "Oslo", "stops": ["Bergen"], "options": {"fast": True}}  # the conversation too


def test_trajectory_views_are_hashable_and_serialise_as_json():
    import copy
    import json
    import pickle

    view, original = _view()
    (call,) = view.calls
    assert {call: 1, view.turns[0]: 2, view: 3}[view] == 3 and len({call, view.turns[0]}) == 2
    assert json.loads(json.dumps(call.arguments)) == original
    assert copy.deepcopy(view) == view and pickle.loads(pickle.dumps(call.arguments)) == call.arguments


@pytest.mark.parametrize("iterations", [-1, 2.5, "2", True, float("nan")])
def test_max_tool_calling_iterations_is_checked_at_start_up(iterations, tmp_path):
    """TRL passes it through unchecked (-1 ran no tool at all, 2.5 ran three rounds)."""
    from trl_mrtpo import MRTPOConfig

    with pytest.raises(ValueError, match=r"max_tool_calling_iterations must be None \(no limit\) or an integer >= 0"):
        MRTPOConfig(output_dir=str(tmp_path), max_tool_calling_iterations=iterations, use_cpu=True, bf16=False)
    assert MRTPOConfig(output_dir=str(tmp_path), max_tool_calling_iterations=0, use_cpu=True, bf16=False)


@pytest.mark.parametrize("names", ["alt", ["alt", 3], [None]])
def test_credit_plot_callback_takes_a_list_of_names(names):
    """A string plotted one reward per character ('a', 'l', 't')."""
    from trl_mrtpo.observability.callbacks import CreditPlotCallback

    with pytest.raises(TypeError, match="takes a list of reward names"):
        CreditPlotCallback(reward_names=names)


@pytest.mark.parametrize(
    "names,history,said",
    [
        (["alt"], [{"rewards/a/mean": 1.0, "mrtpo/beta": 0.5}], "no reward named 'alt' was logged (logged: a)"),
        (None, [{"rewards/a/mean": 1.0, "loss": 0.1}], "logged no MRTPO credit metrics (a `grpo` run"),
    ],
    ids=["unknown reward", "grpo run"],
)
def test_credit_plot_callback_says_why_it_wrote_no_picture(names, history, said, tmp_path, caplog):
    from types import SimpleNamespace

    from trl_mrtpo.observability.callbacks import CreditPlotCallback

    state = SimpleNamespace(is_world_process_zero=True, log_history=history)
    args = SimpleNamespace(output_dir=str(tmp_path), credit_warmup_steps=0)
    with caplog.at_level("WARNING"):
        CreditPlotCallback(reward_names=names).on_train_end(args, state, None)
    assert said in caplog.text and not (tmp_path / "mrtpo_curves.png").exists()


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

    with patch("trl_mrtpo.trainer.sharding_engine", lambda trainer: engine):
        with pytest.raises(ValueError, match=f"'scores_with_the_policy' run the policy .* {engine} does not support"):
            MRTPOTrainer(
                model=tiny_model,
                reward_funcs=[*BASIC.rewards, ScoresWithThePolicy()],
                info_blocks=[*BASIC.info_blocks, None],
                args=make_args(tmp_path, credit_assignment="gdpo"),
                train_dataset=make_basic_dataset(4),
                processing_class=tiny_tokenizer,
            )


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), -0.25, 1.5])
def test_a_checkpointed_strength_outside_its_range_is_refused_naming_the_file(value, tmp_path):
    """Resumed without a word, inf kept a reward at full beta for good and -inf rested it for good."""
    from tests.test_bad_input import IDENTITY, STATE_ENTRIES, _state
    from trl_mrtpo.credit_state import read_credit_state

    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(reward_specificity=torch.tensor([0.2, value], dtype=torch.float64)), path)
    with pytest.raises(ValueError, match=rf"{path}: entry reward_specificity is .* \(each in \[0, 1\], or NaN"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)
    torch.save(_state(reward_specificity=torch.tensor([0.2, float("nan")], dtype=torch.float64)), path)
    assert read_credit_state(str(path), IDENTITY, STATE_ENTRIES)["reward_specificity"][0] == 0.2


def test_self_certainty_scores_the_sampling_distribution_of_a_model_that_scales_its_logits(tmp_path, tiny_tokenizer):
    """Granite divides its logits by 4 in forward: self-certainty is KL(U || p) of what the model samples from,
    computed here from ``model(x).logits / T`` in float64 (it scored at T, as if the logits were unscaled)."""
    import math

    from tests.test_replay import _scaled_model
    from trl_mrtpo import MRTPOConfig, MRTPOTrainer
    from trl_mrtpo.baselines.self_certainty import SelfCertaintyReward
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    model, _ = _scaled_model("granite")
    model.resize_token_embeddings(len(tiny_tokenizer))
    reward = SelfCertaintyReward()
    MRTPOTrainer(
        model=model,
        reward_funcs=[*BASIC.rewards, reward],
        info_blocks=[*BASIC.info_blocks, None],
        args=MRTPOConfig(
            output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", temperature=0.8,
            credit_assignment="gdpo",
        ),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )  # fmt: skip
    prompt = [{"role": "user", "content": "Say hi."}]
    completion_ids = [5, 9, 17, 30]
    (score,) = reward([prompt], ["x"], [completion_ids])
    text = tiny_tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    prompt_ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model.eval()(torch.tensor([prompt_ids + completion_ids])).logits.double()[0]
    logprobs = torch.log_softmax(logits[len(prompt_ids) - 1 : -1] / 0.8, -1)
    expected = (-math.log(logits.shape[-1]) - logprobs.mean(-1)).mean().item()
    assert score == pytest.approx(expected, abs=2e-6)  # fp32: -log V - mean log p cancels to ~5e-4


def test_sample_credit_leaves_the_mode_and_the_strength_state_as_they_were(tiny_model, tiny_tokenizer, tmp_path):
    """What ``inspect`` calls: it read the batch into the running strength and left the model in train mode."""
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, reward_strength_floor=0.25),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.model.eval()
    record = trainer.sample_credit([dict(make_basic_dataset(1)[0])], 4)
    assert record.replayed.any()
    assert not trainer.model.training and torch.isnan(trainer.reward_strength.specificity).all()


@pytest.mark.parametrize("kind", ["encoder", "classifier"])
def test_demo_refuses_a_checkpoint_that_is_not_a_causal_lm(kind, tmp_path, tiny_tokenizer):
    """``demo --model`` on an encoder or a classifier checkpoint never said it was not a causal LM."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForSequenceClassification

    from trl_mrtpo.scripts.demo import check_causal_lm

    if kind == "encoder":
        model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    else:
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)  # fmt: skip
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--model .* not a causal language model"):
        check_causal_lm(str(tmp_path))


def test_calls_that_never_ran_are_in_the_view_with_no_result():
    """With max_tool_calling_iterations=0 (or a rollout that ends first) a completion holds calls and no tool message:
    builders got trajectory=None where docs/agents.md promises the calls with result=None."""
    from trl_mrtpo.trajectories import trajectory

    call = {"function": {"name": "lookup", "arguments": {"city": "Oslo"}}}
    view = trajectory([{"role": "assistant", "content": "", "tool_calls": [call]}], [1, 1, 1])
    assert view is not None and [(c.name, c.result, c.error) for c in view.calls] == [("lookup", None, None)]
    assert view.turns[0].tokens == (0, 3) and view.results == ()
    assert trajectory([{"role": "assistant", "content": "no calls"}], [1, 1]) is None


NOT_CALLABLE = 0.5  # what a recipe's dotted path may name by mistake
A_MODEL_ID = "some-org/some-reward-model"


@pytest.mark.parametrize("attribute,kind", [("NOT_CALLABLE", "float"), ("A_MODEL_ID", "str")])
@pytest.mark.parametrize("role", ["reward", "info_block", "process reward"])
def test_a_dotted_path_to_something_not_callable_is_refused_by_name(attribute, kind, role):
    """A float failed inside TRL ("'float' object has no attribute '__call__'"); a string was fetched from the Hub
    as a reward model."""
    from trl_mrtpo.kits import resolve

    path = f"tests.test_bad_input_round_three.{attribute}"
    with pytest.raises(ValueError, match=rf"{role} '{path}' is a {kind} .*not a function"):
        resolve(path, role)


class _Inspected(Exception):
    """Raised by the patched ``sample_credit``: what ``inspect`` would have scored with, without scoring."""

    def __init__(self, trainer):
        self.trainer = trainer


def says_red_process(prompts, completions, **kwargs):  # a process reward a recipe names by dotted path
    return [[(len(c), 1.0)] for c in completions]


# item 5: each field of a recipe inspect used to ignore, and what the trainer it builds must then hold
RECIPE_FIELDS = [
    ("info_block_separator", 'info_block_separator: "\\n--\\n"\n', lambda t: t.args.info_block_separator == "\n--\n"),
    ("reward_weights", "reward_weights: [2.0, 0.5]\n", lambda t: list(t.args.reward_weights) == [2.0, 0.5, 1.0]),
    ("credit_beta", "credit_beta: 0.2\n", lambda t: t.args.credit_beta == 0.2),
    ("temperature", "temperature: 0.7\n", lambda t: t.args.temperature == 0.7),
    (
        "process_rewards",
        "process_rewards: [tests.test_bad_input_round_three.says_red_process]\n",
        lambda t: [f.__name__ for f in t.step_credit.process_rewards] == ["says_red_process"],
    ),
    (
        "trainer: research",
        "trainer: research\ncredit_assignment: joint\n",
        lambda t: type(t).__name__ == "ResearchTrainer" and t.args.credit_assignment == "joint",
    ),
]


def _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, extra: str, model: bool = True, argv=()):
    import json

    from tests.conftest import build_tiny_model
    from trl_mrtpo.trainer import MRTPOTrainer

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Name a colour {i}."}) for i in range(2)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        (f"model_name_or_path: {model_dir}\n" if model else "")
        + "reward_funcs: [tests.test_inspection.says_red, trl_mrtpo.kits.basic.lowercase_reward]\n"
        + "info_blocks: [tests.test_inspection.red_block, none]\n"
        + f"datasets:\n  - path: json\n    data_files: {data}\n    split: train\n"
        + extra
    )

    def inspected(self, rows, num_generations):
        raise _Inspected(self)

    monkeypatch.setattr(MRTPOTrainer, "sample_credit", inspected)
    with pytest.raises(_Inspected) as caught:
        main(["inspect", "--config", str(recipe), "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens",
              "4", "--output", str(tmp_path / "credit.html"), "--threads", "1", *argv])  # fmt: skip
    return caught.value.trainer, model_dir


@pytest.mark.parametrize("field,line,holds", RECIPE_FIELDS, ids=[f for f, _, _ in RECIPE_FIELDS])
def test_inspect_config_scores_with_the_recipes_credit_settings(
    field, line, holds, tmp_path, tiny_tokenizer, monkeypatch
):
    trainer, _ = _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, line)
    assert holds(trainer), field


def test_inspect_config_flags_given_win_over_the_recipe(tmp_path, tiny_tokenizer, monkeypatch):
    trainer, _ = _inspect_recipe(
        tmp_path,
        tiny_tokenizer,
        monkeypatch,
        "credit_beta: 0.2\ntemperature: 0.7\n",
        argv=["--beta", "0.9", "--temperature", "1.3"],
    )
    assert (trainer.args.credit_beta, trainer.args.temperature) == (0.9, 1.3)


def test_inspect_config_applies_the_adapter_beside_it(tmp_path, tiny_tokenizer, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from tests.conftest import build_tiny_model

    adapter = tmp_path / "adapter"
    get_peft_model(build_tiny_model(tiny_tokenizer), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        adapter
    )
    tiny_tokenizer.save_pretrained(adapter)
    trainer, _ = _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, "", argv=["--adapter", str(adapter)])
    assert any("lora_A" in name for name, _ in trainer.model.named_parameters())


def test_inspect_config_without_a_model_is_refused_as_train_refuses_it(tmp_path, tiny_tokenizer, monkeypatch):
    with pytest.raises(ValueError, match="model_name_or_path is required"):
        _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, "", model=False)


MULTI_ELEMENT_SCORES = {
    "tensor of two": lambda: torch.tensor([0.5, 1.0]),
    "numpy of two": lambda: __import__("numpy").array([0.5, 1.0]),
    "empty tensor": lambda: torch.tensor([]),
}


@pytest.mark.parametrize("path", ["span", "turn"])
@pytest.mark.parametrize("score", list(MULTI_ELEMENT_SCORES), ids=list(MULTI_ELEMENT_SCORES))
def test_a_step_scored_with_several_numbers_is_refused_naming_the_reward(path, score):
    """Item 9: a score that is an array of several (or no) elements crashed inside ``.item()``; a one-element
    tensor is still a number."""
    from trl_mrtpo.steps.process_rewards import checked_steps, checked_turn_steps

    view, _ = _view()
    check = {
        "span": lambda s: checked_steps([(0, 2, s)], "prm", 3, "abc"),
        "turn": lambda s: checked_turn_steps([(view.turns[0], s)], "prm", 3, view),
    }[path]
    with pytest.raises(ValueError, match="Step 0 of the process reward 'prm' on sample 3 has score"):
        check(MULTI_ELEMENT_SCORES[score]())
    assert check(torch.tensor([0.25]))[0][-1 if path == "span" else 0] == 0.25


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
    from trl_mrtpo.validation import checked_rollout

    ids, masks = _ids_and_masks(kind)
    output = {"prompt_ids": [[1], [1]], "completion_ids": ids, "logprobs": None, "env_mask": masks}
    assert checked_rollout(lambda prompts, trainer: output)(["p", "q"], None) is output


def test_an_array_env_mask_of_the_wrong_length_is_refused_naming_the_completion():
    import numpy

    from trl_mrtpo.validation import checked_rollout

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
    from trl_mrtpo.validation import checked_rollout

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
def test_a_reset_returning_what_a_text_model_cannot_read_is_refused_naming_the_environment(observation):
    """Item 14 (and 1): TRL appended ``reset()``'s return to the prompt (``str + dict`` failed inside TRL; content
    parts rendered as nothing for a text model). Text and None pass; content parts pass for a vision-language model."""
    from trl_mrtpo.validation import checked_environment

    class Desk:
        def __init__(self, value):
            self.value = value

        def reset(self, **row):
            return self.value

    with pytest.raises(TypeError, match=r"Desk.reset\(\) returned"):
        checked_environment(Desk(observation), multimodal=False).reset(prompt="p")
    assert checked_environment(Desk("text"), multimodal=False).reset() == "text"
    assert checked_environment(Desk(None), multimodal=False).reset() is None
    if isinstance(observation, list):
        assert checked_environment(Desk(observation), multimodal=True).reset() == observation


@pytest.mark.parametrize(
    "buffer", [{"step": 3}, {"step": -1, "processes": 1, "inputs": []}, {"step": 3, "processes": 1, "inputs": [3]}]
)
def test_a_checkpointed_generation_buffer_of_another_shape_is_refused_naming_the_entry(buffer, tmp_path):
    from tests.test_bad_input import IDENTITY, STATE_ENTRIES, _state
    from trl_mrtpo.credit_state import read_credit_state

    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(generation_buffer=buffer), path)
    with pytest.raises(ValueError, match="mrtpo_state_0.pt: entry generation_buffer is"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_a_version_3_state_reads_as_one_without_a_generation_buffer(tmp_path):
    """Checkpoints written before the buffer was saved still resume (the buffer, if any, is sampled again)."""
    from tests.test_bad_input import IDENTITY, STATE_ENTRIES, _state
    from trl_mrtpo.credit_state import read_credit_state

    old = _state(version=3)
    del old["generation_buffer"]
    torch.save(old, tmp_path / "mrtpo_state_0.pt")
    assert read_credit_state(str(tmp_path / "mrtpo_state_0.pt"), IDENTITY, STATE_ENTRIES)["generation_buffer"] is None


def test_a_generation_buffer_from_another_number_of_processes_is_sampled_again(caplog):
    """A buffer holds its rank's slice of the batch: on another number of processes it is left out, with a warning;
    on the same it is put back with TRL's micro-step counter."""
    from types import SimpleNamespace

    from trl_mrtpo._trl import restore_generation_buffer

    trainer = SimpleNamespace(accelerator=SimpleNamespace(num_processes=1), _step=0, _buffered_inputs=None)
    buffer = {"step": 3, "processes": 2, "inputs": [{"advantages": torch.ones(2)}]}
    restore_generation_buffer(trainer, buffer)
    assert (trainer._step, trainer._buffered_inputs) == (0, None)
    assert any("written on 2 processes; on 1" in record.getMessage() for record in caplog.records)
    restore_generation_buffer(trainer, {**buffer, "processes": 1})
    assert trainer._step == 3 and trainer._buffered_inputs == buffer["inputs"]
