"""Calibrated credit on the credit gym: does each credit option help where paper-MRTPO's q is weak, and does it
ever do worse than GDPO? Arms x gym variants x seeds, paired by seed.

Arms: ``gdpo``, ``mrtpo`` (the paper's method), ``shuffled``, ``oracle`` (q = the ground-truth relevant
positions), each credit option alone on MRTPO, and ``mrtpo+`` (the combination frozen in
``benchmarks/calibrated_credit_choice.json`` before any evaluation seed ran). Variants: the gym's default task and
those of ``trl_mrtpo.gym.VARIANTS``.

Protocol: options and ``mrtpo+`` are chosen with ``--stage dev`` (seeds 0-3) only; ``--stage eval`` runs fresh
seeds (100-115), never used for a choice. Every run is stored under ``--work-dir`` and never recomputed, so the grid
can be run in several sittings, one arm or variant at a time.

    OMP_NUM_THREADS=1 python benchmarks/calibrated_credit.py --stage dev --variants default realistic
    OMP_NUM_THREADS=1 python benchmarks/calibrated_credit.py --stage eval --arms gdpo mrtpo mrtpo+ oracle

Writes ``<stage>/<variant>.md`` (and ``summary.csv``) under ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from trl_mrtpo.gym import KINDS, VARIANTS, RunSettings, localisation, satisfaction, variant_spec
from trl_mrtpo.gym.grid import Run, run_all, summarise
from trl_mrtpo.gym.report import localisation_rows, satisfaction_rows
from trl_mrtpo.gym.stats import paired as paired_difference

HERE = Path(__file__).parent
CHOICE = HERE / "calibrated_credit_choice.json"
SEEDS = {"dev": tuple(range(4)), "eval": tuple(range(100, 116))}
OPTION_ARMS = {
    "null": (("relevance_null_correction", True),),
    "strength": (("reward_strength", True), ("reward_strength_floor", 0.25)),
    "preserve": (("preserve_reward_totals", True),),
}
ARMS = ("gdpo", "mrtpo", "shuffled", "oracle", *OPTION_ARMS, "mrtpo+")
THRESHOLD = 0.75


def arm_settings(arm: str) -> RunSettings:
    if arm in ("gdpo", "mrtpo", "shuffled", "oracle"):
        return RunSettings(method=arm)
    if arm in OPTION_ARMS:
        return RunSettings(method="mrtpo", options=OPTION_ARMS[arm])
    if arm == "mrtpo+":
        if not CHOICE.exists():
            raise SystemExit(f"mrtpo+ is not chosen yet: {CHOICE} is missing (choose it on the dev seeds first)")
        options = json.loads(CHOICE.read_text())["options"]
        return RunSettings(method="mrtpo", options=tuple(sorted((k, v) for k, v in options.items())))
    raise SystemExit(f"unknown arm {arm!r}; arms are {', '.join(ARMS)}")


def report(
    variant: str,
    arms: list[str],
    seeds: tuple[int, ...],
    results: dict,
    runs: list[Run],
    command: str,
    title: str = "Calibrated credit",
):
    """The paired comparison of every arm with gdpo (and with mrtpo), overall and per constraint kind, as markdown;
    the oracle-share column only when the ``oracle`` arm ran."""
    summary = []
    for run in runs:
        row = summarise(run, results[run.key()], THRESHOLD)
        row["method"] = run.value
        summary.append(row)
    gdpo = {r["seed"]: r for r in summary if r["method"] == "gdpo"}
    has_oracle = any(r["method"] == "oracle" for r in summary)
    oracle_gain = paired_difference(summary, "oracle", "gdpo", "final_reward")["mean_difference"] if has_oracle else 0
    lines = [
        f"# {title}, gym variant `{variant}` ({len(seeds)} seeds: {seeds[0]}-{seeds[-1]})",
        "",
        f"Command: `{command}`",
        "",
        f"Task fields: `{json.dumps(VARIANTS[variant])}` (on the default task: K=3, in-prompt blocks, 150 steps).",
        "",
        "| arm | final reward | Δ vs gdpo | W/T/L | p | share of oracle gain |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        values = [r["final_reward"] for r in summary if r["method"] == arm]
        if not values:
            continue
        mean_std = f"{statistics.fmean(values):.3f} ± {statistics.stdev(values) if len(values) > 1 else 0:.3f}"
        if arm == "gdpo" or not gdpo:
            lines.append(f"| {arm} | {mean_std} | (baseline) | | | |")
            continue
        d = paired_difference(summary, arm, "gdpo", "final_reward")
        # meaningful only where the oracle gains over GDPO at all
        share = d["mean_difference"] / oracle_gain if oracle_gain > 0 else math.nan
        lines.append(
            f"| {arm} | {mean_std} | {d['mean_difference']:+.4f} | {d['wins']}/{d['ties']}/{d['losses']} | "
            f"{d['p_value']:.2g} | {'n/a' if math.isnan(share) else f'{share:.2f}'} |"
        )
    others = [arm for arm in arms if arm not in ("gdpo", "mrtpo") and any(r["method"] == arm for r in summary)]
    if others and any(r["method"] == "mrtpo" for r in summary):
        lines += [
            "",
            "Against paper-MRTPO (paired by seed):",
            "",
            "| arm | Δ vs mrtpo | W/T/L | p |",
            "|---|---|---|---|",
        ]
        for arm in others:
            d = paired_difference(summary, arm, "mrtpo", "final_reward")
            lines.append(
                f"| {arm} | {d['mean_difference']:+.4f} | {d['wins']}/{d['ties']}/{d['losses']} | {d['p_value']:.2g} |"
            )
    lines += ["", "Per constraint kind: Δ final reward vs gdpo (W/T/L over seeds).", ""]
    lines += ["| arm | " + " | ".join(KINDS) + " |", "|---" * (len(KINDS) + 1) + "|"]
    for arm in arms:
        if arm == "gdpo" or not any(r["method"] == arm for r in summary) or not gdpo:
            continue
        cells = []
        for kind in KINDS:
            d = paired_difference(summary, arm, "gdpo", f"final_{kind}")
            cells.append(f"{d['mean_difference']:+.3f} ({d['wins']}/{d['ties']}/{d['losses']})")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", summary


def save_report(output: Path, variant: str, markdown: str, summary: list[dict]) -> None:
    """``<variant>.md`` and ``<variant>_summary.json`` in ``output``, and the table on the console."""
    (output / f"{variant}.md").write_text(markdown)
    with open(output / f"{variant}_summary.json", "w") as handle:
        json.dump(summary, handle, indent=1)
    print(markdown, flush=True)


def policy_tables(variant: str, seeds: tuple[int, ...], work_dir: str) -> str:
    """Where q lands on the supervised policies (passing and failing pairs apart), and how much they condition on
    their constraints."""
    spec, policies = variant_spec(variant), str(Path(work_dir) / "policies")
    located = localisation_rows([r for seed in seeds for r in localisation(spec, seed, policies, num_prompts=32)])
    rates = satisfaction_rows([r for seed in seeds for r in satisfaction(spec, seed, policies, num_prompts=32)])
    lines = [
        "",
        "Supervised policy: share of responses meeting a constraint when stated / when removed from the prompt.",
        "",
        "| kind | stated | removed |",
        "|---|---|---|",
        *(f"| {r['kind']} | {r['stated']:.3f} | {r['removed']:.3f} |" for r in rates),
        "",
        "Where q lands (supervised policy): mass ratio on the relevant positions (1 = none), the control's (another",
        "constraint's q on the same positions), and specificity (1 - cos between its q and the others' mean q).",
        "",
        "| kind | responses | pairs | relevant share | mass ratio | control | specificity |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['kind']} | {r['responses']} | {r['pairs']} | {r['relevant_token_share']:.2f} | "
            f"{r['mass_ratio']:.2f} | {r['control_mass_ratio']:.2f} | {r['specificity']:.2f} |"
            for r in located
        ),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=tuple(SEEDS), default="dev")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="override the stage's seeds")
    parser.add_argument("--work-dir", default="gym_runs")
    parser.add_argument("--output-dir", default=str(HERE / "results" / "calibrated_credit"))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--no-policy-tables", action="store_true", help="dev stage: skip the supervised policies' localisation tables"
    )
    args = parser.parse_args()
    seeds = tuple(args.seeds) if args.seeds else SEEDS[args.stage]
    arms = list(dict.fromkeys(["gdpo", *args.arms]))
    command = "python benchmarks/calibrated_credit.py " + " ".join(
        [f"--stage {args.stage}", "--variants " + " ".join(args.variants), "--arms " + " ".join(args.arms)]
    )
    output = Path(args.output_dir) / args.stage
    output.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        spec = variant_spec(variant)
        runs = [Run(spec, arm_settings(arm), seed, variant, arm) for seed in seeds for arm in arms]
        results = run_all(runs, args.work_dir, jobs=args.jobs)
        markdown, summary = report(variant, arms, seeds, results, runs, command)
        if args.stage == "dev" and not args.no_policy_tables:
            markdown += policy_tables(variant, seeds, args.work_dir)
        save_report(output, variant, markdown, summary)


if __name__ == "__main__":
    main()
