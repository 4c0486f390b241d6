"""The gym's experiment: every method over several seeds, sweeps, paired statistics and the written results.

Every run is stored as JSON under ``work_dir/runs`` keyed by everything that defines it, so an interrupted grid
resumes where it stopped and a finished run is never recomputed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .runs import RunSettings
from .task import KINDS, GymSpec

METHODS = ("grpo", "gdpo", "mrtpo", "joint", "shuffled", "cort")  # the default grid's (``oracle`` on request)
MOVING_WINDOW = 10  # steps of the moving mean that must reach the threshold
FINAL_WINDOW = 10  # last steps averaged into the final reward


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


def moving_mean(values: Sequence[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i - window + 1) : i + 1]) for i in range(len(values))]


def steps_to_threshold(values: Sequence[float], threshold: float, window: int = MOVING_WINDOW) -> int | None:
    """First step at which the ``window``-step moving mean (full windows only) reaches ``threshold``."""
    for i in range(window - 1, len(values)):
        if statistics.fmean(values[i - window + 1 : i + 1]) >= threshold:
            return i
    return None


def final_value(values: Sequence[float], window: int = FINAL_WINDOW) -> float:
    tail = [v for v in values[-window:] if not math.isnan(v)]
    return statistics.fmean(tail) if tail else float("nan")


def wilcoxon_signed_rank(differences: Sequence[float]) -> float:
    """Two-sided p-value of the Wilcoxon signed-rank test, exact over every sign pattern (zeros dropped, average
    ranks for ties); 1.0 when no difference is non-zero."""
    values = [d for d in differences if d != 0 and not math.isnan(d)]
    n = len(values)
    if n == 0:
        return 1.0
    if n > 20:
        raise ValueError(f"the exact test enumerates 2^n sign patterns; {n} pairs is too many")
    order = sorted(range(n), key=lambda i: abs(values[i]))
    ranks = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and abs(values[order[j + 1]]) == abs(values[order[i]]):
            j += 1
        for position in range(i, j + 1):
            ranks[order[position]] = (i + j) / 2 + 1
        i = j + 1
    observed = sum(r for r, v in zip(ranks, values) if v > 0)
    centre = sum(ranks) / 2
    extreme = 0
    for signs in itertools.product((0, 1), repeat=n):
        statistic = sum(r for r, s in zip(ranks, signs) if s)
        if abs(statistic - centre) >= abs(observed - centre) - 1e-9:
            extreme += 1
    return extreme / 2**n


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


def paired(rows: Sequence[dict], method: str, baseline: str, column: str, missing: float | None = None) -> dict:
    """``method`` minus ``baseline`` per seed: mean difference, wins/ties/losses (wins = larger), Wilcoxon p.

    ``missing`` replaces an empty value (a run that never reached the threshold counts as the step budget)."""

    def value(row):
        v = row[column]
        return missing if v == "" else float(v)

    by_seed = {r["seed"]: value(r) for r in rows if r["method"] == baseline}
    differences = [value(r) - by_seed[r["seed"]] for r in rows if r["method"] == method and r["seed"] in by_seed]
    differences = [d for d in differences if d is not None and not math.isnan(d)]
    return {
        "pairs": len(differences),
        "mean_difference": statistics.fmean(differences) if differences else float("nan"),
        "wins": sum(d > 0 for d in differences),
        "ties": sum(d == 0 for d in differences),
        "losses": sum(d < 0 for d in differences),
        "p_value": wilcoxon_signed_rank(differences),
    }
