"""The statistics of every comparison the gym and the benchmarks report: moving means, steps to a threshold, final
values, and the paired, exact Wilcoxon signed-rank comparison by seed."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence

MOVING_WINDOW = 10  # steps of the moving mean that must reach the threshold
FINAL_WINDOW = 10  # last steps averaged into the final reward


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


def mean_std(values: Sequence[float]) -> str:
    """``mean ± std`` of the non-NaN values (std 0 for one value), ``n/a`` for none."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "n/a"
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {std:.3f}"
