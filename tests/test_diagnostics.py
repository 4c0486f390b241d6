import math

import torch

from trl_mrtpo.scripts.inspection import mass_share


def test_mass_share_concentrated_spread_and_empty():
    assert mass_share(torch.tensor([0.0, 0.0, 1.0, 0.0])) == 0.25  # one token holds all the mass
    assert mass_share(torch.ones(10)) == 0.8  # evenly spread: 8 of 10 tokens hold 80 %
    assert mass_share(torch.tensor([0.5, 0.3, 0.1, 0.1])) == 0.5  # 0.5 + 0.3 reaches 0.8
    assert math.isnan(mass_share(torch.zeros(3)))
    assert math.isnan(mass_share(torch.zeros(0)))


def test_collapse_monitor_reports_once_per_streak():
    from trl_mrtpo.diagnostics import CollapseMonitor

    monitor = CollapseMonitor(patience=2)
    assert monitor.update({"a": 0.0, "b": 0.1}) == []
    assert monitor.update({"a": 0.0, "b": 0.1}) == ["a"]
    assert monitor.update({"a": 0.0}) == []  # already reported for this streak
    assert monitor.update({"a": 0.5}) == [] and monitor.streaks["a"] == 0
    assert monitor.update({"a": 0.0}) == [] and monitor.update({"a": 0.0}) == ["a"]


def test_process_means_average_each_metric_over_the_processes_that_logged_it():
    from trl_mrtpo.diagnostics import process_means

    gathered = [
        {"mrtpo/beta": 0.5, "mrtpo/replay_seconds": 2.0, "mrtpo/q_mean/a": 0.3},
        {"mrtpo/beta": 0.5, "mrtpo/replay_seconds": 0.0},  # a process with nothing of reward a to replay
    ]
    assert process_means(gathered) == {"mrtpo/beta": 0.5, "mrtpo/replay_seconds": 1.0, "mrtpo/q_mean/a": 0.3}
    assert process_means([{"x": 1.0}]) == {"x": 1.0}
