"""The demo on several seeds: does the tracked reward rise within the demo's steps, and how long does it take.

    OMP_NUM_THREADS=1 python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 --threads 1

Runs ``trl-mrtpo demo`` (its defaults, ``trl_mrtpo.scripts.DEMO_SETTINGS``) once per seed in a fresh process,
timed end to end, and reads each run's ``trainer_state.json``; a seed whose folder already holds the result is not
run again. Writes ``results/demo_seeds.csv`` (per seed: wall seconds, each reward first 5 -> last 5 steps, the
tracked reward, the mean of the rewards, first 5 -> last 5) and prints the table for ``benchmarks/demo.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import time
from pathlib import Path

from provenance import provenance

from trl_mrtpo.observability.callbacks import logged_reward_names
from trl_mrtpo.scripts.demo import reward_trend

HERE = Path(__file__).parent
WINDOW = 5


def window_means(log_history: list[dict]) -> dict[str, tuple[float, float]]:
    """Per reward and for their mean: the mean of the first and of the last ``WINDOW`` logged steps
    (:func:`trl_mrtpo.scripts.demo.reward_trend`)."""
    names = sorted(logged_reward_names(log_history))
    means = {name: (first, last) for name, first, last in reward_trend(log_history, names, WINDOW)}
    firsts, lasts = zip(*means.values())
    means["tracked (mean of rewards)"] = (sum(firsts) / len(firsts), sum(lasts) / len(lasts))
    return means


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, default=None, help="torch threads of each demo (default: the CLI's)")
    parser.add_argument("--work-dir", default="demo_seeds")
    parser.add_argument("--output", default=str(HERE / "results" / "demo_seeds.csv"))
    parser.add_argument("--demo-args", nargs=argparse.REMAINDER, default=[], help="extra arguments for the demo")
    args = parser.parse_args(argv)
    rows = []
    for seed in args.seeds:
        folder = Path(args.work_dir) / f"seed{seed}"
        timing = folder / "wall_seconds.json"
        if not timing.exists():
            command = [sys.executable, "-m", "trl_mrtpo.scripts.cli", "demo", "--seed", str(seed)]
            command += ["--output-dir", str(folder), *args.demo_args]
            command += ["--threads", str(args.threads)] if args.threads else []
            started = time.perf_counter()
            subprocess.run(command, check=True)
            timing.write_text(json.dumps(time.perf_counter() - started))
        means = window_means(json.loads((folder / "trainer_state.json").read_text())["log_history"])
        rows.append(
            {"seed": seed, "wall_s": round(json.loads(timing.read_text()), 1)}
            | {f"{name} first->last": f"{a:.2f} -> {b:.2f}" for name, (a, b) in means.items()}
        )
    with open(args.output, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    Path(args.output + ".provenance.json").write_text(json.dumps(provenance(" ".join(sys.argv)), indent=2))
    print("| " + " | ".join(rows[0]) + " |\n|" + "---|" * len(rows[0]))
    for row in rows:
        print("| " + " | ".join(str(v) for v in row.values()) + " |")


if __name__ == "__main__":
    main()
