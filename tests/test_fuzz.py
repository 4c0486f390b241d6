"""Fuzz: random configuration fields (Python and YAML recipes) and random return values of the user's functions
(info-block builders, process rewards, failure boundaries). Every draw ends in an error that names what was wrong,
or in accepted values whose advantages are finite; none hangs (each case runs under a time limit)."""

import math

import pytest
import torch
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers import time_limit
from trl_mrtpo import MRTPOConfig
from trl_mrtpo.info_blocks import InfoBlock, InfoBlockError, build_block
from trl_mrtpo.steps.credit import process_advantages
from trl_mrtpo.steps.process_rewards import checked_steps, checked_turn_steps, failure_boundary
from trl_mrtpo.trajectories import trajectory

CASE_SECONDS = 20  # far above any case's cost (milliseconds); a hang fails instead of blocking the suite


OWN_FIELDS = [name for name in MRTPOConfig.__dataclass_fields__ if name not in ("gradient_checkpointing",)]
OWN_FIELDS = [name for name in OWN_FIELDS if name not in __import__("trl").GRPOConfig.__dataclass_fields__]
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "mrtpo", "gdpo", "cort", "concur", "saw", "torch", "0.5", "\n\n"]),
    st.lists(st.one_of(st.none(), st.floats(-2, 2), st.text(max_size=3)), max_size=3),
)
FIELDS = st.dictionaries(st.sampled_from([*OWN_FIELDS, "reward_weights", "temperature"]), ANY_VALUE, max_size=3)


def assert_named(error: Exception, drawn: dict) -> None:
    """The error names one of the drawn fields."""
    assert any(name in str(error) for name in drawn), f"{type(error).__name__} names no drawn field: {error}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(drawn=FIELDS)
def test_config_fields_end_in_a_named_error_or_a_valid_config(drawn):
    with time_limit(CASE_SECONDS):
        try:
            config = MRTPOConfig(output_dir="fuzz", use_cpu=True, bf16=False, report_to="none", **drawn)
        except (TypeError, ValueError) as error:
            assert_named(error, drawn)
            event("refused")
            return
    event("accepted")
    for name in drawn:  # accepted: every number is finite, every list of weights numbers
        value = getattr(config, name)
        assert not (isinstance(value, float) and not math.isfinite(value)), name
        if name.endswith("weights") and value is not None:
            assert all(isinstance(w, (int, float)) and math.isfinite(w) for w in value), name


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    drawn=st.dictionaries(
        st.sampled_from([*OWN_FIELDS, "reward_weights", "num_prompts", "reward_funcs"]), ANY_VALUE, max_size=3
    )
)
def test_recipe_yaml_ends_in_a_named_error_or_parses(tmp_path_factory, drawn):
    from trl_mrtpo.scripts.train import make_parser

    path = tmp_path_factory.mktemp("recipe") / "recipe.yaml"
    recipe = {"task": "basic", "use_cpu": True, "bf16": False, "output_dir": str(path.parent), **drawn}
    path.write_text(yaml.safe_dump(recipe))
    with time_limit(CASE_SECONDS):
        try:
            make_parser().parse_args_and_config(["--config", str(path)])
            event("parsed")
        except (TypeError, ValueError) as error:
            assert_named(error, drawn)
            event("refused")
        except SystemExit:  # argparse refusing a value: it prints the field's name on stderr
            event("argparse")


RETURNED = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 50),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.builds(InfoBlock, st.text(max_size=8)),
    st.lists(st.one_of(st.integers(-2, 20), st.floats(allow_nan=True), st.text(max_size=2)), max_size=4),
    st.lists(st.tuples(st.integers(-2, 14), st.integers(-2, 14), st.floats(allow_nan=True)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
PROMPT = [{"role": "user", "content": "Write one line. End with OK."}]
COMPLETION = "Hello there OK"


@settings(max_examples=200, deadline=None)
@given(returned=RETURNED)
def test_info_block_builders_end_in_a_named_error_or_a_block(returned):
    with time_limit(CASE_SECONDS):
        try:
            block = build_block(lambda **_: returned, "ending", 3, PROMPT, COMPLETION, {}, 0.0)
        except InfoBlockError as error:
            assert "reward 'ending' on sample 3" in str(error)
            return
    assert block is None or (isinstance(block, InfoBlock) and block.text.strip())


@settings(max_examples=200, deadline=None)
@given(returned=RETURNED)
def test_failure_boundaries_end_in_a_named_error_or_an_offset(returned):
    with time_limit(CASE_SECONDS):
        try:
            offset = failure_boundary(lambda **_: returned, "ending", 2, PROMPT, COMPLETION, {}, -1.0)
        except (TypeError, ValueError) as error:
            assert "reward 'ending' on sample 2" in str(error)
            return
    assert offset is None or (isinstance(offset, int) and 1 <= offset <= len(COMPLETION))


def named_or_checked(check, name: str, returned: list) -> list | None:
    """Each response's checked steps, or None when one is refused by an error naming ``name`` and its sample."""
    steps = []
    for sample, result in enumerate(returned):
        try:
            steps.append(check(result, name, sample))
        except (TypeError, ValueError) as error:
            assert f"process reward '{name}' on sample {sample}" in str(error)
            return None
    return steps


def process_advantages_of(steps: list[list[tuple[float, int]]], num_positions: int) -> torch.Tensor:
    """Process advantages of four responses' ``(score, last token)`` steps, in groups of two."""
    width = max(1, max(len(s) for s in steps))
    scores = torch.full((4, width), float("nan"), dtype=torch.float64)
    ends = torch.zeros((4, width), dtype=torch.long)
    for j, response in enumerate(steps):
        for s, (score, end) in enumerate(response):
            scores[j, s], ends[j, s] = score, end
    return process_advantages(scores, ends, 2, num_positions)


@settings(max_examples=200, deadline=None)
@given(returned=st.lists(RETURNED, min_size=4, max_size=4))
def test_process_rewards_end_in_a_named_error_or_finite_advantages(returned):
    with time_limit(CASE_SECONDS):
        steps = named_or_checked(lambda r, n, i: checked_steps(r, n, i, COMPLETION), "steps", returned)
        if steps is None:
            return
        advantages = process_advantages_of([[(s.score, min(s.end - 1, 5)) for s in r] for r in steps], 6)
    assert torch.isfinite(advantages).all()


CALL = {"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oz"}}}
ROLLOUT = [
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "lookup", "content": "{'error': 'Oz is not a city'}"},
    {"role": "assistant", "content": "Sorry."},
]
VIEW = trajectory(ROLLOUT, [1, 1, 1, 0, 0, 1, 1])  # turns on tokens [0, 3) and [5, 7)
FOREIGN = trajectory(ROLLOUT, [1, 1, 0, 1]).turns[1]  # equal text and calls, other tokens
TURN_STEPS = st.one_of(
    RETURNED,
    st.lists(
        st.tuples(
            st.sampled_from([*VIEW.turns, FOREIGN, None, 0, "Sorry."]),
            st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.integers(-5, 5), st.text()),
        ),
        max_size=3,
    ),
)


@settings(max_examples=200, deadline=None)
@given(returned=st.lists(TURN_STEPS, min_size=4, max_size=4))
def test_turn_process_rewards_end_in_a_named_error_or_finite_advantages(returned):
    """On a tool rollout, whatever a process reward returns ends in an error naming it and the sample, or in steps
    that end on a turn's last token and finite advantages."""
    with time_limit(CASE_SECONDS):
        steps = named_or_checked(lambda r, n, i: checked_turn_steps(r, n, i, VIEW), "turns", returned)
        if steps is None:
            return
        assert {end for response in steps for _, end in response} <= {2, 6}
        advantages = process_advantages_of(steps, 7)
    assert torch.isfinite(advantages).all()


@pytest.mark.parametrize("separator", ["", None])
def test_no_separator_can_make_step_splitting_loop(separator):
    from trl_mrtpo.steps.process_rewards import step_spans

    with time_limit(5), pytest.raises((ValueError, TypeError)):
        step_spans("a\nb", separator)
