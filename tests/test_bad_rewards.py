"""Bad rewards: what a reward function, a process reward, a verifier or a recipe's reward names return or name, and
rewards at any float32 scale. Each case ends in a clear error naming the function and the sample, or in the
float64 reference's numbers."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_args, token_advantages, train
from tests.reference import reference_token_advantages
from tests.test_bad_info_blocks import _view
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.checks.batch import check_reward_values, checked_reward
from trl_mrtpo.credit import group_advantages
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.steps.process_rewards import checked_steps
from trl_mrtpo.steps.step_labels import MathShepherd

NAN, INF = float("nan"), float("inf")


# ---------------------------------------------------------------- reward return values
@pytest.mark.parametrize(
    "values, error, message",
    [
        ({"a": 1.0, "b": 0.0, "c": 1.0}, TypeError, "reward function 'r' returned a dict"),
        ("101", TypeError, "reward function 'r' returned a str"),
        (None, TypeError, "reward function 'r' returned a NoneType"),
        (1.0, TypeError, "reward function 'r' returned a float"),
        ([1.0, 0.0], ValueError, "returned 2 rewards for 3 completions"),
        ([1.0, [0.0], 1.0], TypeError, "returned list .* for sample 1"),
        ([1.0, "1", 1.0], TypeError, "returned str '1' for sample 1"),
        ([1.0, 0.0, 1 + 2j], TypeError, "returned complex .* for sample 2"),
        ([1.0, INF, 1.0], ValueError, "returned inf for sample 1"),
        ([-INF, 0.0, 1.0], ValueError, "returned -inf for sample 0"),
        ([1e39, 0.0, 1.0], ValueError, "returned 1e\\+39 for sample 0; .* float32's range"),
        ([torch.ones(2), 0.0, 1.0], TypeError, r"tensor of shape \(2,\) .* for sample 0"),
        ([torch.tensor(1j), 0.0, 1.0], TypeError, "tensor of shape .* for sample 0"),
        ([np.array([1.0, 2.0]), 0.0, 1.0], TypeError, "returned ndarray .* for sample 0"),
    ],
)
def test_bad_reward_values_name_the_function_and_sample(values, error, message):
    with pytest.raises(error, match=message):
        check_reward_values("r", values, 3)


@pytest.mark.parametrize(
    "values, expected",
    [
        ([1, 0.5, True], [1.0, 0.5, 1.0]),
        ([None, 0.0, 2.0], [None, 0.0, 2.0]),
        ([np.float32(0.25), np.int64(3), np.bool_(False)], [0.25, 3.0, 0.0]),
        ([torch.tensor(0.5), torch.tensor([2.0]), torch.tensor(True)], [0.5, 2.0, 1.0]),
        (np.array([1.0, 0.0, 3e38]), [1.0, 0.0, 3e38]),
        (torch.tensor([1.0, 0.0, -1.0]), [1.0, 0.0, -1.0]),
        ((0.0, 1.0, 0.0), [0.0, 1.0, 0.0]),
    ],
)
def test_good_reward_values_become_floats(values, expected):
    checked = check_reward_values("r", values, 3)
    assert [v is None for v in checked] == [e is None for e in expected]
    assert [v for v in checked if v is not None] == pytest.approx([e for e in expected if e is not None], rel=1e-6)


def test_nan_reward_means_does_not_apply():
    assert math.isnan(check_reward_values("r", [NAN, 1.0], 2)[0])


def test_trainer_checks_reward_values_where_they_return(tiny_model, tiny_tokenizer, tmp_path):
    def as_dict(completions, **_):
        return {i: 1.0 for i in range(len(completions))}

    with pytest.raises(TypeError, match="reward function 'as_dict' returned a dict"):
        train(tiny_model, tiny_tokenizer, tmp_path, rewards=[as_dict, *BASIC.rewards[1:]])


def test_trainer_checks_async_reward_values(tiny_model, tiny_tokenizer, tmp_path):
    async def strings(completions, **_):
        return ["1"] * len(completions)

    with pytest.raises(TypeError, match="reward function 'strings' returned str '1' for sample 0"):
        train(tiny_model, tiny_tokenizer, tmp_path, rewards=[strings, *BASIC.rewards[1:]])


# ---------------------------------------------------------------- statistics at user scale
@pytest.mark.parametrize("scale", [1.0, 1e19, 2e19, 1e30, 3e38])
def test_group_advantages_at_any_float32_scale(scale):
    rewards = torch.tensor([[0.0], [1.0], [0.0], [1.0]]) * scale
    advantages, varying = group_advantages(rewards, 4)
    assert varying.all()
    # (r - mean) / (std + 1e-4), std = sqrt(1/3) (Bessel) of 0/1 values, in float64
    expected = 0.5 * scale / (math.sqrt(1 / 3) * scale + 1e-4)
    torch.testing.assert_close(advantages[:, 0], torch.tensor([-expected, expected, -expected, expected]))


@pytest.mark.parametrize("weight", [1e19, 1e30])
def test_the_cap_binds_at_any_reward_weight(weight):
    """Scaling every reward weight scales nothing after step 8: the cap and the advantages are those at weight 1."""
    gen = torch.Generator().manual_seed(0)
    advantages, varying = group_advantages(torch.randint(0, 2, (8, 2), generator=gen).float(), 4)
    q, mask = torch.rand(8, 2, 6, generator=gen), torch.ones(8, 6, dtype=torch.long)
    small = token_advantages(advantages, q, varying, mask, torch.ones(2), 1.0, 1.1)
    large = token_advantages(advantages, q, varying, mask, torch.full((2,), weight), 1.0, 1.1)
    assert small.cap_factor < 1 and large.cap_factor == pytest.approx(small.cap_factor, rel=1e-5)
    torch.testing.assert_close(large.advantages, small.advantages, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- random reward outputs and weights
value = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.sampled_from([0.0, 1.0, 0.5, 1e19, -2e30, 3e38, 1e39]),
)


@settings(max_examples=200, deadline=None)
@given(
    columns=st.lists(st.lists(value, min_size=8, max_size=8), min_size=1, max_size=3),
    weights=st.lists(st.sampled_from([1.0, 0.5, 2.0, 1e19, 1e30]), min_size=3, max_size=3),
    beta=st.floats(0, 1),
    seed=st.integers(0, 2**16),
)
def test_a_clear_error_or_the_float64_reference(columns, weights, beta, seed):
    names = [f"reward_{k}" for k in range(len(columns))]
    checked = []
    for name, column in zip(names, columns):
        try:
            checked.append(check_reward_values(name, column, 8))
        except (TypeError, ValueError) as error:
            assert name in str(error) and "sample" in str(error)
            return
    rewards = torch.tensor([[NAN if v is None else v for v in row] for row in zip(*checked)], dtype=torch.float32)
    c = torch.tensor(weights[: len(columns)])
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.arange(5)[None] < torch.randint(1, 6, (8,), generator=gen)[:, None]).long()
    q = torch.rand(8, len(columns), 5, generator=gen)
    advantages, varying = group_advantages(rewards, 4)
    credit = token_advantages(advantages, q, varying, mask, c, beta, 2.0)
    expected, _ = reference_token_advantages(rewards, q, mask, c, beta, 2.0, 4)
    assert torch.isfinite(credit.advantages).all()
    torch.testing.assert_close(credit.advantages.double(), expected, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", ["/", "no_such_reward", "os.no_such_function"])
def test_recipe_reward_names_that_resolve_to_nothing(name):
    from trl_mrtpo.kits import resolve

    with pytest.raises(ValueError, match=f"(unknown|cannot import) reward {name!r}"):
        resolve(name, "reward")


@pytest.mark.parametrize(
    "missing, call, extra",
    [
        ("sqlglot", lambda: __import__("trl_mrtpo.kits").kits.get_kit("sql"), "sql"),
        ("if_verifiable", lambda: __import__("trl_mrtpo.kits").kits.get_kit("if"), "if"),
        ("nltk", lambda: __import__("trl_mrtpo.kits").kits.get_kit("if"), "if"),
    ],
)
def test_a_kit_without_its_extra_names_the_install(monkeypatch, missing, call, extra):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a))
    with pytest.raises(ImportError, match=f"needs the '{missing}' package.*pip install \"trl-mrtpo\\[{extra}\\]\""):
        call()


def test_a_dotted_path_resolves_without_any_kit(monkeypatch):
    """On a core install (no kit extras) a user's reward by dotted path resolves; a kit's name says which kits could
    not be searched."""
    import importlib.util

    from trl_mrtpo import kits

    real = importlib.util.find_spec
    missing = {"sqlglot", "if_verifiable", "nltk"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))
    imported, real_get_kit = [], kits.get_kit
    monkeypatch.setattr(kits, "get_kit", lambda name: imported.append(name) or real_get_kit(name))
    assert kits.resolve("json.dumps", "reward") is __import__("json").dumps
    assert kits.resolve("json.loads", "process_reward") is __import__("json").loads
    assert imported == []  # no kit was imported for a dotted path
    with pytest.raises(ValueError, match="unknown reward 'no_such_reward'.*Not searched: the 'sql' kit needs"):
        kits.resolve("no_such_reward", "reward")


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


NOT_CALLABLE = 0.5  # what a recipe's dotted path may name by mistake

A_MODEL_ID = "some-org/some-reward-model"


@pytest.mark.parametrize("attribute,kind", [("NOT_CALLABLE", "float"), ("A_MODEL_ID", "str")])
@pytest.mark.parametrize("role", ["reward", "info_block", "process reward"])
def test_a_dotted_path_to_something_not_callable_is_refused_by_name(attribute, kind, role):
    """A float failed inside TRL ("'float' object has no attribute '__call__'"); a string was fetched from the Hub
    as a reward model."""
    from trl_mrtpo.kits import resolve

    path = f"tests.test_bad_rewards.{attribute}"
    with pytest.raises(ValueError, match=rf"{role} '{path}' is a {kind} .*not a function"):
        resolve(path, role)


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


def graded(completions, solution, **kwargs):
    """Reads a `solution` column the dataset lacks."""
    return [float(s in c) for c, s in zip(completions, solution)]


def test_a_reward_column_the_dataset_lacks_is_named_before_the_model_loads(tmp_path, monkeypatch):
    """It surfaced after a full generation step as TRL's bare TypeError; now the constructor names the function, the
    column and the dataset's columns, before the model loads. Arguments TRL supplies are never asked of the data."""
    import trl.trainer.grpo_trainer as grpo
    from datasets import Dataset

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(grpo, "create_model_from_path", never)

    def uses_trl_arguments(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
        return [0.0] * len(completions)

    data = Dataset.from_list([{"prompt": "Say hi.", "answer": "hi"}] * 4)
    with pytest.raises(
        ValueError, match=r"reward function 'graded' needs the column 'solution'.*columns: prompt, answer"
    ):
        MRTPOTrainer(model="some/model", reward_funcs=[uses_trl_arguments, graded], args=make_args(tmp_path),
                     train_dataset=data)  # fmt: skip


def test_an_eval_dataset_that_lacks_a_column_a_reward_needs_is_found_before_the_model_loads(tmp_path, monkeypatch):
    """It was found at the first evaluation, after training steps ran (needs_answer() missing 1 required positional
    argument); now the constructor names the function, the column and the eval dataset (each of several by key)."""
    import trl.trainer.grpo_trainer as grpo
    from datasets import Dataset

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(grpo, "create_model_from_path", never)
    train = Dataset.from_list([{"prompt": "Say hi.", "solution": "hi"}] * 4)
    held_out = Dataset.from_list([{"prompt": "Say hi.", "answer": "hi"}] * 4)
    for eval_dataset, named in (
        (held_out, "eval dataset"),
        ({"math": train, "chat": held_out}, "eval 'chat' dataset"),
    ):
        with pytest.raises(ValueError, match=rf"reward function 'graded' needs the column 'solution'.*{named} lacks"):
            MRTPOTrainer(model="some/model", reward_funcs=[graded], args=make_args(tmp_path), train_dataset=train,
                         eval_dataset=eval_dataset)  # fmt: skip


def test_a_reward_that_returns_none_for_an_unparseable_answer(tiny_model, tiny_tokenizer, tmp_path):
    """None for some samples of a group (an answer it could not parse) gives those samples advantage 0, not a
    penalty: warned about once, naming the reward and the group (nothing was said); None for a whole group, or a
    reward that applies to every sample, is not warned about."""
    import warnings

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    def parsed(completions, **_):  # the second sample of every group "cannot be parsed"
        return [None if i % 4 == 1 else float(len(c) % 2) for i, c in enumerate(completions)]

    def whole_groups(completions, **_):  # does not apply to the second prompt
        return [None if i // 4 == 1 else float(len(c) % 3) for i, c in enumerate(completions)]

    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=[*BASIC.rewards, parsed, whole_groups],
        args=make_args(tmp_path, max_steps=2, credit_assignment="gdpo"),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    said = [str(w.message) for w in caught if "for some samples of group" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        "The reward function 'parsed' returned None for some samples of group 0"
    )
    assert "Return 0.0" in said[0]


def test_a_reward_constant_over_ten_generation_batches_is_warned_about_once():
    """A reward that gave every sample 0.0 for 10 generation batches (a wrong database path, say) is named with its
    value, once; one that varies once in those batches, or is cut off earlier, is not."""
    import warnings

    from trl_mrtpo.checks.batch import CONSTANT_REWARD_BATCHES

    def run(batches, values):
        scored = iter(values)
        reward = checked_reward(lambda completions, **_: next(scored), "db_reward")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(batches):
                reward(completions=["a", "b"])
        return [str(w.message) for w in caught if "same value" in str(w.message)]

    constant = [[0.0, 0.0]] * 20
    (message,) = run(20, constant)
    assert "'db_reward' gave every sample the same value, 0, over the first 10 generation batches" in message
    assert run(CONSTANT_REWARD_BATCHES - 1, constant) == []
    assert run(20, [[0.0, 0.0]] * 5 + [[0.0, 1.0]] + [[0.0, 0.0]] * 14) == []
    assert run(20, [[None, 1.0]] * 20) != []  # None is TRL's "does not apply": the values it gave are still one


def test_rewards_that_share_a_name_get_distinct_ones(tiny_model, tiny_tokenizer, tmp_path):
    """Two lambdas (TRL allows them) would share one metric, one collapse streak and one checkpoint entry: the second
    is ``<lambda>_2``, as TRL's logs name it, wherever MRTPO names it."""
    from trl_mrtpo.checks.inputs import distinct

    assert distinct(["a", "a", "a_2", "b", "a"]) == ["a", "a_3", "a_2", "b", "a_4"]
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=[
            lambda completions, **_: [1.0] * len(completions),
            lambda completions, **_: [0.0] * len(completions),
        ],
        args=make_args(tmp_path),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    assert trainer.reward_func_names == ["<lambda>", "<lambda>_2"]
