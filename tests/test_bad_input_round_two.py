"""Bad input, round two: the surfaces added since the first suite (process rewards, PRM, Math-Shepherd, OPSD, config
field types, YAML recipes, checkpoints) and the families the first suite missed. One meaningful case per way of
being wrong; each ends in a clear error naming the field, reward, function, file and sample, or in correct numbers."""

import math

import pytest
import torch
from datasets import Dataset

from tests.helpers import make_args
from tests.test_bad_input import IDENTITY, STATE_ENTRIES, _state
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.credit import group_advantages, token_advantages
from trl_mrtpo.credit_state import read_credit_state
from trl_mrtpo.info_blocks import InfoBlock, InfoBlockError, build_block
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.steps.process_rewards import checked_steps
from trl_mrtpo.steps.step_labels import MathShepherd
from trl_mrtpo.validation import check_dataset, check_reward_values, checked_reward

NAN = float("nan")


# ---------------------------------------------------------------- numbers at the edge of float range
def test_reward_weights_near_float32_max_give_the_advantages_of_weight_one():
    """c_k A_k summed over rewards passes float32's range at weights of 3e38: combined in float64, the rescaled
    advantages are those of weights 1 (the rescale is scale-free)."""
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    advantages, varying = group_advantages(rewards, 2)
    q = torch.rand(4, 2, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 5, dtype=torch.long)
    huge = token_advantages(advantages, q, varying, mask, torch.tensor([3e38, 3e38]), 0.5).advantages
    unit = token_advantages(advantages, q, varying, mask, torch.ones(2), 0.5).advantages
    assert huge.dtype == torch.float32 and torch.isfinite(huge).all()
    torch.testing.assert_close(huge, unit, rtol=1e-5, atol=1e-6)


def test_a_step_score_beyond_float32_is_named():
    """Scores of 1e308 overflow the group statistics in float64 (their squares): refused like rewards are."""
    with pytest.raises(ValueError, match="Step 0 of the process reward 'steps' on sample 4 has score 1e\\+308"):
        checked_steps([(0, 2, 1e308)], "steps", 4, "abc")


def test_a_reward_too_large_for_any_float_is_named():
    with pytest.raises(ValueError, match="reward function 'r' returned 1000000000.* for sample 1"):
        check_reward_values("r", [0.0, 10**400], 2)


# ---------------------------------------------------------------- user functions get copies
def test_a_reward_function_that_edits_prompts_and_completions_changes_nothing_for_others():
    def vandal(prompts, completions, **_):
        prompts[0][0]["content"] = "HACKED"
        completions[0][0]["content"] = "HACKED"
        return [1.0] * len(completions)

    prompts = [[{"role": "user", "content": "Say hi."}]]
    completions = [[{"role": "assistant", "content": "hi"}]]
    assert checked_reward(vandal, "vandal")(prompts=prompts, completions=completions) == [1.0]
    assert prompts[0][0]["content"] == "Say hi." and completions[0][0]["content"] == "hi"


def test_a_process_reward_that_edits_prompts_changes_nothing_the_trainer_keeps(tiny_model, tiny_tokenizer, tmp_path):
    def vandal_steps(prompts, completions, **_):
        for prompt in prompts:
            prompt[-1]["content"] += " HACKED"
        return [None] * len(completions)

    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        process_rewards=[vandal_steps],
        args=make_args(tmp_path, credit_assignment="mrtpo", max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert not any("HACKED" in str(prompt) for prompt in trainer.last_credit.prompts)


# ---------------------------------------------------------------- Math-Shepherd's verifier
def _shepherd(verifier, tiny_model, tiny_tokenizer, **kwargs):
    return MathShepherd(verifier, model=tiny_model, tokenizer=tiny_tokenizer, max_new_tokens=4, **kwargs)


@pytest.mark.parametrize(
    "verdict, message",
    [
        (None, "returned NoneType None"),
        ("yes", "returned str 'yes'"),
        ([1.0], "returned list"),
        (NAN, "returned float nan"),
    ],
)
def test_a_bad_verdict_names_the_verifier_and_sample(tiny_model, tiny_tokenizer, verdict, message):
    def check(prompt, completion, row):
        return verdict if completion == "two words" else True

    shepherd = _shepherd(check, tiny_model, tiny_tokenizer)
    # one step per response: its label is the verdict on the response itself (no sampling)
    with pytest.raises(TypeError, match=f"math_shepherd's verifier 'check' on sample 1 {message}"):
        shepherd.label(["p", "q"], ["one step", "two words"])


def test_a_raising_verifier_is_named_with_the_sample(tiny_model, tiny_tokenizer):
    def check(prompt, completion, row):
        return row["answer"] in completion  # no such column

    with pytest.raises(RuntimeError, match="verifier 'check' on sample 0 raised KeyError: 'answer'"):
        _shepherd(check, tiny_model, tiny_tokenizer).label(["p"], ["one step"])


def test_a_nan_threshold_is_refused():
    with pytest.raises(ValueError, match="threshold must be a finite number, got nan"):
        MathShepherd(lambda *_: 1.0, threshold=NAN)


# ---------------------------------------------------------------- OPSD scores with the same checks
def test_opsd_reward_values_are_checked(tiny_model, tiny_tokenizer, tmp_path):
    from trl_mrtpo.baselines.opsd import opsd_config, opsd_trainer_class

    def bad(completions, **_):
        return [{"score": 1.0}] * len(completions)

    trainer = opsd_trainer_class()(
        tiny_model,
        [bad],
        [BASIC.info_blocks[0]],
        opsd_config(make_args(tmp_path, max_steps=1)),
        make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    with pytest.raises(TypeError, match="reward function 'bad' returned dict .* for sample 0"):
        trainer.train()


# ---------------------------------------------------------------- options where they do nothing
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(credit_assignment="grpo", preserve_reward_totals=True), "preserve_reward_totals=True has no effect"),
        (dict(credit_assignment="cort", preserve_reward_totals=True), "preserve_reward_totals=True has no effect"),
        (dict(credit_assignment="mrtpo", cort_eta=0.5), "cort_eta=0.5 has no effect unless credit_assignment='cort'"),
        (dict(concur_ceiling=0.5), "concur_ceiling=0.5 has no effect unless reward_weighting='concur'"),
        (dict(taco_threshold=2.0), "taco_threshold=2.0 has no effect unless taco_strength > 0"),
        (
            dict(credit_assignment="joint", reward_strength_floor=0.3),
            "reward_strength_floor=0.3 has no effect unless credit_assignment is one of mrtpo, shuffled",
        ),
    ],
)
def test_an_option_that_would_do_nothing_is_refused(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **fields)


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


def test_an_in_prompt_span_found_twice_overlapping_is_refused():
    prompt = [{"role": "user", "content": "Sing ababa."}]
    with pytest.raises(InfoBlockError, match="occurs 2 times in the prompt"):
        build_block(lambda **_: InfoBlock("aba", placement="in_prompt"), "r", 0, prompt, "", {}, 1.0)


# ---------------------------------------------------------------- config field types: Python, command line, YAML
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("reward_weights", 1.0, "reward_weights must be list\\[float\\] \\| None, got float 1.0"),
        ("process_reward_weights", "1", "process_reward_weights must be list\\[float\\] \\| None, got str"),
        ("credit_beta", "0.5", "credit_beta must be float, got str '0.5'"),
        ("credit_warmup_steps", 2.5, "credit_warmup_steps must be int, got float 2.5"),
        ("info_block_separator", None, "info_block_separator must be str, got NoneType"),
        ("replay_only_varying", "yes", "replay_only_varying must be bool, got str"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_named(tmp_path, field, value, message):
    with pytest.raises(TypeError, match=message):
        make_args(tmp_path, **{field: value})


@pytest.mark.parametrize(
    "recipe, extra, error, message",
    [
        ("reward_weights: [1.0, null]\n", [], TypeError, "reward_weights must be list\\[float\\] \\| None, got list"),
        ("reward_funcs: my_pkg.rewards.fn\n", [], TypeError, "reward_funcs must be list\\[str\\] \\| None, got str"),
        ("info_block_separator: null\n", [], TypeError, "info_block_separator must be str, got NoneType"),
        ("num_prompts: 0\n", [], ValueError, "num_prompts must be >= 1, got 0"),
        ("", ["--num_prompts", "-3"], ValueError, "num_prompts must be >= 1, got -3"),
    ],
)
def test_a_recipe_or_command_line_of_the_wrong_type_is_named(tmp_path, recipe, extra, error, message):
    from trl_mrtpo.scripts.train import make_parser

    path = tmp_path / "recipe.yaml"
    path.write_text(f"task: basic\nuse_cpu: true\nbf16: false\noutput_dir: {tmp_path}\n{recipe}")
    with pytest.raises(error, match=message):
        make_parser().parse_args_and_config(["--config", str(path), *extra])


# ---------------------------------------------------------------- checkpoint state contents
@pytest.mark.parametrize(
    "changes, entry",
    [
        (dict(reward_specificity=torch.zeros(3)), "reward_specificity"),
        (dict(reward_specificity=torch.zeros(2, dtype=torch.long)), "reward_specificity"),
        (dict(shuffle_generator=torch.zeros(7, dtype=torch.uint8)), "shuffle_generator"),
        (dict(concur_trust={"1": {"count": 3, "total": 1.0}}), "concur_trust is \\['1'\\]"),
        (
            dict(concur_trust={"1": {"count": 2.5, "total": 1.0, "total_squares": 1.0, "min_readings": 4}}),
            "concur_trust is \\['1'\\].count = 2.5",
        ),
        (dict(collapse_streaks={"a": -1}), "collapse_streaks"),
        (dict(optimizer_hint=1), "optimizer_hint"),
    ],
)
def test_an_inconsistent_checkpoint_state_names_the_file_and_entry(tmp_path, changes, entry):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(**changes), path)
    with pytest.raises(ValueError, match=f"{path}: entry {entry}"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_a_truncated_checkpoint_state_names_the_file(tmp_path):
    path = tmp_path / "mrtpo_state_0.pt"
    torch.save(_state(), path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=f"{path} cannot be read as MRTPO's checkpoint state"):
        read_credit_state(str(path), IDENTITY, STATE_ENTRIES)


def test_the_round_two_families_leave_good_input_alone(tmp_path):
    """The new checks refuse nothing a correct run gives them (a finite reward, typed fields, a proper state)."""
    assert check_reward_values("r", [0.0, 3e38, None], 3) == [0.0, 3e38, None]
    assert make_args(tmp_path, reward_weights=[1, 2.5], credit_beta=1).credit_beta == 1
    path = tmp_path / "mrtpo_state_0.pt"
    trust = {"1": {"count": 3, "total": 1.0, "total_squares": 1.0, "min_readings": 4}}
    torch.save(_state(concur_trust=trust, collapse_streaks={"a": 2}), path)
    assert read_credit_state(str(path), IDENTITY, STATE_ENTRIES)["concur_trust"] == trust
    assert math.isfinite(checked_steps([(0, 1, 3e38)], "p", 0, "ab")[0].score)
    Dataset.from_list([{"prompt": [{"role": "user", "content": "hi"}]}])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("credit_beta", 10**400, "credit_beta must be a finite number"),
        ("max_second_moment_ratio", -(10**400), "max_second_moment_ratio must be a finite number"),
        ("reward_weights", [1.0, 10**400], "reward_weights\\[1\\] must be a finite number"),
    ],
)
def test_an_integer_too_large_for_any_float_is_named(tmp_path, field, value, message):
    """An int beyond any float (10**400) in a configuration field: a named ValueError, not a bare OverflowError."""
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **{field: value})


def test_the_train_command_refuses_a_bad_value_with_its_message_not_a_traceback(capsys):
    """``trl-mrtpo train`` with a value a configuration refuses (an unknown credit rule, a beta out of range): the
    message, after the usage line, exit status 2, as argparse refuses a flag; not a traceback."""
    from trl_mrtpo.scripts.cli import main

    for flag, value, message in [
        ("--credit_assignment", "mrtop", "credit_assignment='mrtop' is unknown; choose one of mrtpo, gdpo, grpo"),
        ("--credit_beta", "2", "credit_beta must be in [0, 1], got 2.0."),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(["train", "--config", "recipes/cpu/basic-smollm2.yaml", flag, value])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: trl-mrtpo train") and f"error: {message}" in err
