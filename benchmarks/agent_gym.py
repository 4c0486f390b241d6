"""The agent gym's pre-registered comparisons: GDPO vs MRTPO (the published rule) on multi-turn tool rollouts whose
deciding tokens are known, paired by seed, and where each reward's q lands per turn
(``benchmarks/agent_gym_protocol.md``); and, with ``--strength``, MRTPO's default credit (per-reward strength) on the
same seeds (``benchmarks/agent_gym_strength_protocol.md``).

    OMP_NUM_THREADS=1 python benchmarks/agent_gym.py
    OMP_NUM_THREADS=1 python benchmarks/agent_gym.py --strength

Resumable: each (method, seed) run and each seed's localisation is a JSON file under ``--work-dir``, never
recomputed. Writes ``benchmarks/agent_gym.md`` (tables) and ``benchmarks/results/agent_gym/summary.csv``.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from provenance import provenance

from trl_mrtpo.gym.agent import (
    REWARD_NAMES,
    AgentGymSpec,
    AgentRunSettings,
    agent_localisation,
    train_agent_run,
)
from trl_mrtpo.gym.stats import final_value, paired

HERE = Path(__file__).parent
SEEDS = tuple(range(300, 316))  # held out: never used for a choice
METHODS = ("gdpo", "mrtpo")
ARMS = {  # run settings of each arm; run records are named by arm
    "gdpo": {"method": "gdpo"},
    "mrtpo": {"method": "mrtpo"},  # the published rule
    "strength": {"method": "mrtpo", "reward_strength": True},  # per-reward strength, floor 0.25: the default
}
SETTINGS = {"steps": 60, "prompts_per_step": 8, "num_generations": 4, "learning_rate": 5e-4, "temperature": 1.0}
TURNS = ("first call", "middle calls", "last call", "answer")


def stored(path: Path, compute):
    """The JSON at ``path``, computed and written (beside, then renamed) only when missing."""
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(value))
    partial.replace(path)
    return value


def summary_rows(work_dir: Path, seeds, arms=METHODS) -> list[dict]:
    rows = []
    for seed in seeds:
        for method in arms:
            records = json.loads((work_dir / f"{method}-seed{seed}.json").read_text())
            row = {"seed": seed, "method": method, "auc": statistics.fmean(r["mean_reward"] for r in records)}
            for name in REWARD_NAMES:
                row[f"auc/{name}"] = statistics.fmean(r[name] for r in records)
                row[f"final/{name}"] = final_value([r[name] for r in records])
            row["final"] = final_value([r["mean_reward"] for r in records])
            rows.append(row)
    return rows


def localisation_table(records: list[dict]) -> list[str]:
    lines = [
        "| reward | trajectories | median ratio on its word | median control | truth turn | "
        + " | ".join(f"q share: {t}" for t in TURNS)
        + " |",
        "|---|---|---|---|---|" + "---|" * len(TURNS),
    ]
    for name in REWARD_NAMES:
        rows = [r for r in records if r["reward"] == name]
        ratios = [r["ratio"] for r in rows if r["ratio"] == r["ratio"]]
        controls = [r["control"] for r in rows if r["control"] == r["control"]]
        truth = statistics.mode(r["truth_turn"] for r in rows)
        shares = [statistics.fmean(r.get(f"share/{t}", 0.0) for r in rows) for t in TURNS]
        lines.append(
            f"| {name} | {len(rows)} | {statistics.median(ratios):.2f} | {statistics.median(controls):.2f} | "
            + f"{truth} | "
            + " | ".join(f"{s:.2f}" for s in shares)
            + " |"
        )
    return lines


COLUMNS = ["auc", *(f"auc/{n}" for n in REWARD_NAMES), "final", *(f"final/{n}" for n in REWARD_NAMES)]


def comparison_lines(rows: list[dict], method: str, baseline: str) -> list[str]:
    """The paired table of ``method`` against ``baseline`` over every column (exact two-sided Wilcoxon)."""

    def line(column: str) -> str:
        result = paired(rows, method, baseline, column)
        means = {m: statistics.fmean(r[column] for r in rows if r["method"] == m) for m in (baseline, method)}
        return (
            f"| {column} | {means[baseline]:.3f} | {means[method]:.3f} | {result['mean_difference']:+.3f} | "
            f"{result['wins']}/{result['ties']}/{result['losses']} | {result['p_value']:.3g} |"
        )

    return [
        f"| measure | {baseline} | {method} | mean difference | wins/ties/losses | p |",
        "|---|---|---|---|---|---|",
        *(line(c) for c in COLUMNS),
    ]


def verdict(rows: list[dict], method: str, baseline: str) -> str:
    """The pre-registered rule: ``method`` helps only if its mean AUC difference is positive and p < 0.05."""
    primary = paired(rows, method, baseline, "auc")
    helps = primary["mean_difference"] > 0 and primary["p_value"] < 0.05
    behind = [c for c in COLUMNS if paired(rows, method, baseline, c)["mean_difference"] < 0]
    name, other = (n.upper() if n in ("mrtpo", "gdpo") else n for n in (method, baseline))
    return (
        f"**Primary (area under the mean-reward curve): {f'{name} helps' if helps else 'no significant gain'}** "
        f"(difference {primary['mean_difference']:+.4f}, p = {primary['p_value']:.3g}). "
        + (f"{name} is behind {other} on average in: {', '.join(behind)}." if behind else f"{name} is behind on none.")
    )


def report(rows: list[dict], localisation: list[dict], seeds) -> str:
    return "\n".join(
        [
            "# Agent gym: GDPO vs MRTPO on multi-turn tool rollouts",
            "",
            "Protocol, settings and decision rule frozen before any evaluation seed ran:",
            "[agent_gym_protocol.md](agent_gym_protocol.md). Command:",
            "",
            "    OMP_NUM_THREADS=1 python benchmarks/agent_gym.py",
            "",
            f"Seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}, paired); 60 steps, 8 prompts x 4 trajectories per step.",
            "",
            "## Learning (mrtpo - gdpo, paired by seed; exact two-sided Wilcoxon)",
            "",
            *comparison_lines(rows, "mrtpo", "gdpo"),
            "",
            verdict(rows, "mrtpo", "gdpo"),
            "",
            "## Where q lands (the supervised policy, held-out prompts, before RL)",
            "",
            "Mass ratio: a reward's share of q mass on the one word that decides it over that word's share of the",
            "model's tokens (1 = no localisation); control: another reward's q on the same word. Turn shares: the",
            "mean share of the reward's q mass in each turn; the truth is in the turn named.",
            "",
            *localisation_table(localisation),
            "",
        ]
    )


def arm_run(spec, arm: str, seed: int, cache_dir: str) -> list[dict]:
    """One RL run of ``arm`` (:data:`ARMS`) at the protocol's settings, in a scratch output directory."""
    settings = AgentRunSettings(**ARMS[arm], **SETTINGS)
    return train_agent_run(spec, settings, seed, cache_dir, tempfile.mkdtemp())


def reproduced(spec, seed: int, cache_dir: str, work_dir: Path) -> dict:
    """The protocol's check: the stored gdpo and mrtpo runs of ``seed`` recomputed on this commit, equal or not."""
    check = {"seed": seed, "commit": provenance("")["commit"]}
    for method in METHODS:
        again = arm_run(spec, method, seed, cache_dir)
        check[method] = again == json.loads((work_dir / f"{method}-seed{seed}.json").read_text())
    return check


def strength_report(rows: list[dict], seeds, check: dict) -> str:
    return "\n".join(
        [
            "# Agent gym: MRTPO's default credit (per-reward strength) vs GDPO",
            "",
            "Protocol and decision rule frozen before any strength run:",
            "[agent_gym_strength_protocol.md](agent_gym_strength_protocol.md). Command:",
            "",
            "    OMP_NUM_THREADS=1 python benchmarks/agent_gym.py --strength",
            "",
            f"Seeds {seeds[0]}-{seeds[-1]} ({len(seeds)}, paired); the gdpo and mrtpo (published rule) runs are",
            "those of [agent_gym.md](agent_gym.md); settings as there. Reproducibility check (the protocol's): seed",
            f"{check['seed']}'s gdpo and mrtpo runs recomputed at {check['commit']} equal the stored records: "
            f"gdpo {check['gdpo']}, mrtpo {check['mrtpo']}.",
            "",
            "## Primary: strength - gdpo (paired by seed; exact two-sided Wilcoxon)",
            "",
            *comparison_lines(rows, "strength", "gdpo"),
            "",
            verdict(rows, "strength", "gdpo"),
            "",
            "## Secondary: strength - mrtpo (the published rule)",
            "",
            *comparison_lines(rows, "strength", "mrtpo"),
            "",
        ]
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", default=str(HERE / "results" / "agent_gym" / "runs"))
    parser.add_argument("--cache-dir", default=str(Path(tempfile.gettempdir()) / "trl_mrtpo_agent_gym"))
    parser.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS))
    parser.add_argument("--strength", action="store_true", help="the second comparison: the strength arm")
    parser.add_argument("--report", default=None, help="default: agent_gym.md (agent_gym_strength.md with --strength)")
    args = parser.parse_args(argv)
    arms = ("gdpo", "mrtpo", "strength") if args.strength else METHODS
    report_path = args.report or str(HERE / ("agent_gym_strength.md" if args.strength else "agent_gym.md"))
    torch.set_num_threads(1)
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    spec = AgentGymSpec()
    localisation = []
    for seed in args.seeds:
        locate = functools.partial(agent_localisation, spec, seed, args.cache_dir)
        localisation += stored(work_dir / f"localisation-seed{seed}.json", locate)
        for method in arms:
            run = functools.partial(arm_run, spec, method, seed, args.cache_dir)
            stored(work_dir / f"{method}-seed{seed}.json", run)
            print(f"seed {seed} {method}: done", flush=True)
    if args.strength:  # the stored runs are reused only if they reproduce on this commit (the protocol)
        check = stored(
            work_dir / f"reproduced-seed{args.seeds[0]}.json",
            functools.partial(reproduced, spec, args.seeds[0], args.cache_dir, work_dir),
        )
        if not (check["gdpo"] and check["mrtpo"]):
            raise SystemExit(f"the stored runs do not reproduce ({check}): rerun every arm into a fresh --work-dir")
    rows = summary_rows(work_dir, args.seeds, arms)
    summary = Path(args.work_dir).parent / ("summary_strength.csv" if args.strength else "summary.csv")
    with open(summary, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    text = strength_report(rows, args.seeds, check) if args.strength else report(rows, localisation, args.seeds)
    Path(report_path).write_text(text)
    Path(f"{summary}.provenance.json").write_text(json.dumps(provenance(" ".join(sys.argv)), indent=2))
    print(f"wrote {report_path} and {summary}")


if __name__ == "__main__":
    sys.exit(main())
