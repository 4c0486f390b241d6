"""The gym's experiment: every method over several seeds, sweeps, paired statistics and the written results.

Every run is stored as JSON under ``work_dir/runs`` keyed by everything that defines it, so an interrupted grid
resumes where it stopped and a finished run is never recomputed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .runs import RunSettings
from .stats import final_value, steps_to_threshold
from .task import KINDS, GymSpec

METHODS = ("grpo", "gdpo", "mrtpo", "joint", "shuffled", "cort")  # the default grid's (``oracle`` on request)


@dataclass(frozen=True)
class Run:
    """One RL run: the task, the method's settings, the seed, and the sweep it belongs to (for the tables)."""

    spec: GymSpec
    settings: RunSettings
    seed: int
    sweep: str = "main"
    value: str = ""

    def key(self) -> str:
        text = json.dumps({"spec": self.spec.identity(), "settings": self.settings.identity(), "seed": self.seed})
        return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class Grid:
    """What ``trl-mrtpo gym`` runs and how it reports."""

    spec: GymSpec = field(default_factory=GymSpec)
    settings: RunSettings = field(default_factory=RunSettings)
    methods: Sequence[str] = METHODS
    seeds: Sequence[int] = tuple(range(8))
    threshold: float = 0.75
    localisation_prompts: int = 32
    sweep_seeds: int = 4  # the first seeds of ``seeds`` that every sweep point runs (gdpo and mrtpo each)
    device: str = "cpu"  # where policies train and runs sample (not part of a run's key)

    def main_runs(self) -> list[Run]:
        return [Run(self.spec, replace(self.settings, method=m), seed) for m in self.methods for seed in self.seeds]

    def sweep_runs(self) -> list[Run]:
        """GDPO vs MRTPO, one setting changed at a time from the main grid's."""
        runs = []
        variations: list[tuple[str, str, GymSpec, RunSettings]] = []
        for k in (6, 12):
            variations.append(("num_constraints", str(k), replace(self.spec, num_constraints=k), self.settings))
        variations.append(("placement", "appended", replace(self.spec, placement="appended"), self.settings))
        for lr in (5e-5, 3e-4):
            variations.append(("learning_rate", f"{lr:g}", self.spec, replace(self.settings, learning_rate=lr)))
        for beta in (0.25, 0.75):
            variations.append(("credit_beta", f"{beta:g}", self.spec, replace(self.settings, credit_beta=beta)))
        for rho in (1.25, 4.0):
            variations.append(
                ("max_second_moment_ratio", f"{rho:g}", self.spec, replace(self.settings, max_second_moment_ratio=rho))
            )
        for sweep, value, spec, settings in variations:
            for method, seed in itertools.product(("gdpo", "mrtpo"), self.seeds[: self.sweep_seeds]):
                if method == "gdpo" and sweep in ("credit_beta", "max_second_moment_ratio"):
                    settings_used = self.settings  # gdpo ignores both: its main-grid run (same key) is the baseline
                else:
                    settings_used = settings
                runs.append(Run(spec, replace(settings_used, method=method), seed, sweep, value))
        return runs


def large_grid() -> Grid:
    """The grid for one GPU machine (``benchmarks/gpu_gym.sh``): twice the seeds, K=6, a larger tiny policy."""
    return Grid(
        spec=GymSpec(num_constraints=6, hidden_size=128, num_layers=4),
        seeds=tuple(range(16)),
        localisation_prompts=16,
        device="cuda",
    )


def quick_grid() -> Grid:
    """A smoke-sized grid (about a minute on one core): tiny supervised phase, few steps, two seeds."""
    return Grid(
        spec=GymSpec(sft_teach_steps=80, sft_calibrate_steps=20),
        settings=RunSettings(steps=12, prompts_per_step=4, num_generations=4, credit_warmup_steps=2),
        methods=("grpo", "gdpo", "mrtpo"),
        seeds=(0, 1),
        localisation_prompts=4,
    )


def _pin_one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _execute(run: Run, work_dir: str, device: str) -> tuple[str, list[dict]]:
    from .runs import train_run

    folder = Path(work_dir)
    stored = folder / "runs" / f"{run.key()}.json"
    if stored.exists():  # finished meanwhile by another sitting on the same work dir
        return run.key(), json.loads(stored.read_text())["records"]
    records = train_run(run.spec, run.settings, run.seed, folder / "policies", folder / "trainer" / run.key(), device)
    return run.key(), records


def _prepare_policy(spec: GymSpec, seed: int, work_dir: str, device: str) -> None:
    from .task import supervised_policy

    supervised_policy(spec, seed, Path(work_dir) / "policies", device=device)


def _map(function: Callable, jobs: int, *iterables: Iterable) -> Iterable:
    if jobs <= 1:
        return map(function, *iterables)
    import multiprocessing

    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_pin_one_thread)
    return pool.map(function, *iterables)


def run_all(
    runs: Sequence[Run], work_dir: str | Path, jobs: int = 1, progress: bool = True, device: str = "cpu"
) -> dict[str, list]:
    """Every run's per-step records, computing only those not already stored in ``work_dir/runs``."""
    from tqdm.auto import tqdm

    stored = Path(work_dir) / "runs"
    stored.mkdir(parents=True, exist_ok=True)
    results: dict[str, list] = {}
    todo: dict[str, Run] = {}
    for run in runs:
        path = stored / f"{run.key()}.json"
        if path.exists():
            results[run.key()] = json.loads(path.read_text())["records"]
        else:
            todo.setdefault(run.key(), run)
    # supervised policies first, one per (task, seed), so parallel runs never train the same one twice
    policies = sorted({(run.spec, run.seed) for run in todo.values()}, key=lambda p: p[1])
    if policies:
        specs, seeds = zip(*policies)
        list(_map(_prepare_policy, jobs, specs, seeds, [str(work_dir)] * len(specs), [device] * len(specs)))
    pending = list(todo.values())
    bar = tqdm(total=len(pending), desc="gym runs", disable=not progress)
    for key, records in _map(_execute, jobs, pending, [str(work_dir)] * len(pending), [device] * len(pending)):
        run = todo[key]
        payload = {"spec": asdict(run.spec), "settings": asdict(run.settings), "seed": run.seed, "records": records}
        temporary = stored / f"{key}.json.tmp"
        temporary.write_text(json.dumps(payload))
        os.replace(temporary, stored / f"{key}.json")
        results[key] = records
        bar.update()
    bar.close()
    return results


def summarise(run: Run, records: Sequence[dict], threshold: float) -> dict:
    """One run's summary: steps to threshold, final mean reward, and the final reward of each kind."""
    means = [r["mean_reward"] for r in records]
    reached = steps_to_threshold(means, threshold)
    row = {
        "sweep": run.sweep,
        "value": run.value,
        "method": run.settings.method,
        "seed": run.seed,
        "steps_to_threshold": "" if reached is None else reached,
        "final_reward": final_value(means),
    }
    for kind in KINDS:
        row[f"final_{kind}"] = final_value([r[f"kind/{kind}"] for r in records])
    return row
