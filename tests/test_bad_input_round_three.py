"""Round three of bad input: the surfaces added since round two, tried as a new user would. Each case ends in a clear
error naming what is wrong, before any model is loaded or any step runs."""

import pytest

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
