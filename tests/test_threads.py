"""The CPU thread rule of the commands: the free cores, never every core of a busy machine."""

import os

import pytest

from trl_mrtpo.scripts import default_threads


@pytest.mark.parametrize(
    "cores, load, expected", [(2, 0.0, 2), (2, 0.4, 2), (2, 1.0, 1), (2, 3.7, 1), (16, 4.2, 12), (4, 0.0, 4)]
)
def test_default_threads_leave_busy_cores_alone(monkeypatch, cores, load, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cores)), raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, 0.0, 0.0))
    assert default_threads() == expected


def test_no_load_average(monkeypatch):
    def unavailable():
        raise OSError

    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2}, raising=False)
    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert default_threads() == 3


def test_train_takes_a_thread_option():
    from trl_mrtpo.scripts.train import make_parser

    script_args, *_ = make_parser().parse_args_and_config(
        ["--task", "basic", "--threads", "1", "--output_dir", "x", "--use_cpu", "true", "--bf16", "false"]
    )
    assert script_args.threads == 1
