"""The gym's written results: CSV files, curves and the markdown tables quoted in README."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from ..observability.viz import moving_mean
from .grid import Grid, Run, summarise
from .stats import MOVING_WINDOW, mean_std, paired
from .task import KINDS


def _fmt(value: float, digits: int = 3) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _write_csv(path: Path, rows: Sequence[dict]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def comparison_rows(summary: Sequence[dict], methods: Sequence[str], steps: int, baseline: str = "gdpo") -> list:
    """Every method against ``baseline``, paired by seed, on final reward and on steps to threshold."""
    rows = []
    for method in methods:
        if method == baseline:
            continue
        final = paired(summary, method, baseline, "final_reward")
        speed = paired(summary, method, baseline, "steps_to_threshold", missing=float(steps))
        rows.append(
            {
                "method": method,
                "baseline": baseline,
                "pairs": final["pairs"],
                "final_reward_difference": final["mean_difference"],
                "final_wins": final["wins"],
                "final_ties": final["ties"],
                "final_losses": final["losses"],
                "final_p_value": final["p_value"],
                # fewer steps is better: a "win" on speed is a negative difference
                "steps_difference": speed["mean_difference"],
                "faster": speed["losses"],
                "same_speed": speed["ties"],
                "slower": speed["wins"],
                "steps_p_value": speed["p_value"],
            }
        )
    return rows


def localisation_rows(records: Sequence[dict]) -> list[dict]:
    """Per constraint kind, over all responses and separately for those that meet the constraint (``satisfied``)
    and those that do not (``failing``): mean mass ratio on the true positions, and the control's."""
    rows = []
    groups = (
        ("all", lambda r: True),
        ("satisfied", lambda r: r["satisfied"] == 1),
        ("failing", lambda r: r["satisfied"] == 0),
    )
    for kind in KINDS:
        for label, keep in groups:
            chosen = [r for r in records if r["kind"] == kind and keep(r) and not math.isnan(r["ratio"])]
            if not chosen:
                continue
            controls = [r["control"] for r in chosen if not math.isnan(r["control"])]
            rows.append(
                {
                    "kind": kind,
                    "responses": label,
                    "pairs": len(chosen),
                    "relevant_token_share": statistics.fmean(r["relevant_share"] for r in chosen),
                    "mass_ratio": statistics.fmean(r["ratio"] for r in chosen),
                    "control_mass_ratio": statistics.fmean(controls) if controls else float("nan"),
                    "specificity": statistics.fmean(r.get("specificity", math.nan) for r in chosen),
                }
            )
    return rows


def satisfaction_rows(records: Sequence[dict]) -> list[dict]:
    """Per constraint kind: the supervised policy's satisfaction rate with the constraint stated and removed."""
    rows = []
    for kind in KINDS:
        chosen = [r for r in records if r["kind"] == kind]
        if chosen:
            rows.append(
                {
                    "kind": kind,
                    "constraints": len(chosen),
                    "stated": statistics.fmean(r["stated"] for r in chosen),
                    "removed": statistics.fmean(r["removed"] for r in chosen),
                }
            )
    return rows


def plot_curves(runs: Sequence[Run], results: dict, methods: Sequence[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for method in methods:
        curves = [
            moving_mean([r["mean_reward"] for r in results[run.key()]], MOVING_WINDOW)
            for run in runs
            if run.settings.method == method
        ]
        if not curves:
            continue
        length = min(len(c) for c in curves)
        mean = [statistics.fmean(c[i] for c in curves) for i in range(length)]
        std = [statistics.pstdev([c[i] for c in curves]) for i in range(length)]
        (line,) = axes.plot(range(length), mean, label=f"{method} ({len(curves)} seeds)")
        axes.fill_between(
            range(length),
            [m - s for m, s in zip(mean, std)],
            [m + s for m, s in zip(mean, std)],
            alpha=0.15,
            color=line.get_color(),
        )
    axes.set_xlabel("RL step")
    axes.set_ylabel(f"mean reward ({MOVING_WINDOW}-step moving mean)")
    axes.set_title(title)
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_results(
    grid: Grid,
    main: Sequence[Run],
    sweeps: Sequence[Run],
    results: dict,
    localisation: Sequence[dict],
    output_dir: str | Path,
    command: str,
    satisfaction: Sequence[dict] = (),
) -> str:
    """Write ``runs.csv``, ``summary.csv``, ``comparison.csv``, ``localisation.csv``, ``sweeps.csv``,
    ``curves.png`` and ``results.md`` in ``output_dir``; return the markdown."""
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    steps = grid.settings.steps
    _write_csv(
        output / "runs.csv",
        [
            {"sweep": run.sweep, "value": run.value, "method": run.settings.method, "seed": run.seed, **record}
            for run in (*main, *sweeps)
            for record in results[run.key()]
        ],
    )
    summary = [summarise(run, results[run.key()], grid.threshold) for run in main]
    _write_csv(output / "summary.csv", summary)
    comparison = comparison_rows(summary, grid.methods, steps)
    _write_csv(output / "comparison.csv", comparison)
    located = localisation_rows(localisation)
    _write_csv(output / "localisation.csv", located)
    supervised = satisfaction_rows(satisfaction)
    _write_csv(output / "supervised_policy.csv", supervised)
    plot_curves(
        main,
        results,
        grid.methods,
        output / "curves.png",
        f"credit gym: K={grid.spec.num_constraints}, {grid.spec.placement}, lr {grid.settings.learning_rate:g}",
    )

    lines = [
        "# Credit gym results",
        "",
        f"Command: `{command}`",
        "",
        f"Task: K={grid.spec.num_constraints} constraints per prompt, {grid.spec.length}-word responses, "
        f"{grid.spec.placement} info blocks; {grid.settings.prompts_per_step} prompts x "
        f"{grid.settings.num_generations} responses per step, {steps} steps, learning rate "
        f"{grid.settings.learning_rate:g}, credit_beta "
        f"{grid.settings.credit_beta:g}, cap rho {grid.settings.max_second_moment_ratio:g}; seeds "
        f"{', '.join(map(str, grid.seeds))}. Threshold: the {MOVING_WINDOW}-step moving mean of the mean reward "
        f"reaches {grid.threshold:g} (a run that never does counts as {steps} steps in the paired test).",
        "",
        "## The supervised policy (before RL)",
        "",
        "Share of sampled responses meeting a constraint when the prompt states it, and when that constraint is "
        "removed from the prompt (held-out prompts, 4 samples each, every seed).",
        "",
        "| kind | constraints | stated | removed |",
        "|---|---|---|---|",
        *[f"| {r['kind']} | {r['constraints']} | {r['stated']:.3f} | {r['removed']:.3f} |" for r in supervised],
        "",
        "## Learning, per method",
        "",
        "| method | final reward | steps to threshold | reached | Δ final vs gdpo | W/T/L | p "
        "| Δ steps vs gdpo | faster/same/slower | p |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_method = {row["method"]: row for row in comparison}
    for method in grid.methods:
        rows = [r for r in summary if r["method"] == method]
        reached = [float(r["steps_to_threshold"]) for r in rows if r["steps_to_threshold"] != ""]
        cells = [
            method,
            mean_std([r["final_reward"] for r in rows]),
            mean_std(reached) if reached else "not reached",
            f"{len(reached)}/{len(rows)}",
        ]
        c = by_method.get(method)
        if c is None:
            cells += ["(baseline)"] + [""] * 5
        else:
            cells += [
                f"{c['final_reward_difference']:+.3f}",
                f"{c['final_wins']}/{c['final_ties']}/{c['final_losses']}",
                _fmt(c["final_p_value"]),
                f"{c['steps_difference']:+.1f}",
                f"{c['faster']}/{c['same_speed']}/{c['slower']}",
                _fmt(c["steps_p_value"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "W/T/L: seeds where the method's final reward is higher / equal / lower than gdpo's. p: two-sided exact "
        "Wilcoxon signed-rank test over seeds.",
        "",
        "## Final reward per constraint kind",
        "",
        "| method | " + " | ".join(KINDS) + " |",
        "|---|" + "---|" * len(KINDS),
    ]
    for method in grid.methods:
        rows = [r for r in summary if r["method"] == method]
        lines.append(
            f"| {method} | " + " | ".join(mean_std([r[f"final_{kind}"] for r in rows]) for kind in KINDS) + " |"
        )
    lines += [
        "",
        "## Where q lands (supervised policy, before RL)",
        "",
        "Mass ratio: share of a reward's q mass on the positions whose word can flip that reward, divided by their "
        "share of the tokens (1 = no localisation). Control: the same positions under the removal of another "
        "constraint of the prompt, which that reward does not depend on.",
        "",
        "| kind | responses | pairs | relevant token share | mass ratio | control |",
        "|---|---|---|---|---|---|",
    ]
    for row in located:
        lines.append(
            f"| {row['kind']} | {row['responses']} | {row['pairs']} | {row['relevant_token_share']:.2f} | "
            f"{row['mass_ratio']:.2f} | {_fmt(row['control_mass_ratio'], 2)} |"
        )
    if sweeps:
        sweep_rows = []
        for sweep, value in dict.fromkeys((run.sweep, run.value) for run in sweeps):
            chosen = [run for run in sweeps if (run.sweep, run.value) == (sweep, value)]
            rows = [summarise(run, results[run.key()], grid.threshold) for run in chosen]
            final = paired(rows, "mrtpo", "gdpo", "final_reward")
            speed = paired(rows, "mrtpo", "gdpo", "steps_to_threshold", missing=float(chosen[0].settings.steps))
            sweep_rows.append(
                {
                    "sweep": sweep,
                    "value": value,
                    "gdpo_final": statistics.fmean(r["final_reward"] for r in rows if r["method"] == "gdpo"),
                    "mrtpo_final": statistics.fmean(r["final_reward"] for r in rows if r["method"] == "mrtpo"),
                    "final_difference": final["mean_difference"],
                    "final_wins": final["wins"],
                    "final_losses": final["losses"],
                    "final_p_value": final["p_value"],
                    "steps_difference": speed["mean_difference"],
                    "steps_p_value": speed["p_value"],
                }
            )
        _write_csv(output / "sweeps.csv", sweep_rows)
        lines += [
            "",
            "## Sweeps: mrtpo vs gdpo, one setting changed at a time",
            "",
            "| setting | value | gdpo final | mrtpo final | Δ final | W/L | p | Δ steps | p |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sweep_rows:
            lines.append(
                f"| {r['sweep']} | {r['value']} | {r['gdpo_final']:.3f} | {r['mrtpo_final']:.3f} | "
                f"{r['final_difference']:+.3f} | {r['final_wins']}/{r['final_losses']} | {_fmt(r['final_p_value'])} | "
                f"{r['steps_difference']:+.1f} | {_fmt(r['steps_p_value'])} |"
            )
    markdown = "\n".join(lines) + "\n"
    (output / "results.md").write_text(markdown)
    return markdown


def run_and_report(grid: Grid, sweeps: bool, jobs: int, work_dir: str, output_dir: str | Path, command: str) -> str:
    """Run (or resume) the grid's main runs, and its sweeps when asked, measure localisation and the supervised
    policy's satisfaction per seed, write every result in ``output_dir`` and return the markdown summary."""
    import os

    from ..kits import require
    from .grid import run_all
    from .runs import localisation, satisfaction

    require("matplotlib", "The gym's report (its curves)", 'pip install "trl-mrtpo[gym]"')  # before hours of runs

    main_runs = grid.main_runs()
    sweep_runs = grid.sweep_runs() if sweeps else []
    results = run_all([*main_runs, *sweep_runs], work_dir, jobs=jobs, device=grid.device)
    policies = os.path.join(work_dir, "policies")
    options = {"num_prompts": grid.localisation_prompts, "device": grid.device}
    located = [r for seed in grid.seeds for r in localisation(grid.spec, seed, policies, **options)]
    rates = [r for seed in grid.seeds for r in satisfaction(grid.spec, seed, policies, **options)]
    return write_results(grid, main_runs, sweep_runs, results, located, output_dir, command, rates)


def run_gym_command(
    quick: bool,
    large: bool,
    sweeps: bool,
    seeds: int | None,
    methods: Sequence[str] | None,
    sweep_seeds: int,
    jobs: int,
    work_dir: str,
    output_dir: str,
) -> str:
    """``trl-mrtpo gym``: the grid its flags name (``quick``, ``large`` or the default), run and reported
    (:func:`run_and_report`); prints and returns the markdown summary."""
    import os

    from . import Grid, large_grid, quick_grid

    grid = quick_grid() if quick else large_grid() if large else Grid()
    if grid.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("trl-mrtpo gym --large needs a CUDA device; none is available here.")
    if seeds is not None:
        grid.seeds = tuple(range(seeds))
    if methods:
        grid.methods = tuple(methods)
    grid.sweep_seeds = sweep_seeds
    flags = {"quick": quick, "large": large, "sweeps": sweeps}
    command = "trl-mrtpo gym" + "".join(f" --{flag}" for flag, given in flags.items() if given)
    if sweeps and sweep_seeds != 4:
        command += f" --sweep-seeds {sweep_seeds}"
    markdown = run_and_report(grid, sweeps, jobs, work_dir, output_dir, command)
    print(markdown)
    print(f"Results written to {os.path.abspath(output_dir)}")
    return markdown
