"""The field's other credit rules on the credit gym: process rewards (an oracle PRM, Math-Shepherd labels from the
policy) and failure-suffix masking, alone and on MRTPO, against GDPO and MRTPO, paired by seed.

Arms: ``gdpo``; ``mrtpo`` (the paper's method); ``prm`` (gdpo + the oracle process reward: each word a step, scored
1 while the response can still meet every constraint); ``shepherd`` (gdpo + Math-Shepherd soft labels, 4 sampled
continuations per step prefix, verified by "every constraint met"); ``mask`` (gdpo + failure-suffix masking at each
failing constraint's last relevant position); ``mrtpo+mask``; ``opsd`` (TRL's self-distillation, the constraint
sentences restated as the live teacher's privileged context). Settings are those frozen in
``benchmarks/step_credit_protocol.md`` before any evaluation seed ran; nothing is tuned.

    OMP_NUM_THREADS=1 python benchmarks/step_credit.py --variants default --jobs 1

Every run is stored under ``--work-dir`` and never recomputed. Writes ``<variant>.md`` and ``<variant>_summary.json``
under ``--output-dir``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from calibrated_credit import report, save_report

from trl_mrtpo.gym import VARIANTS, RunSettings, variant_spec
from trl_mrtpo.gym.grid import Run, run_all

HERE = Path(__file__).parent
SEEDS = tuple(range(200, 216))  # fresh: never used by any other gym benchmark or for a choice
ARMS = {
    "gdpo": RunSettings(method="gdpo"),
    "mrtpo": RunSettings(method="mrtpo"),
    "prm": RunSettings(method="gdpo", process="oracle"),
    "shepherd": RunSettings(method="gdpo", process="shepherd", shepherd_rollouts=4),
    "mask": RunSettings(method="gdpo", failure_masking=True),
    "mrtpo+mask": RunSettings(method="mrtpo", failure_masking=True),
    "opsd": RunSettings(method="opsd"),  # added by the protocol's amendment
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--work-dir", default="gym_runs")
    parser.add_argument("--output-dir", default=str(HERE / "results" / "step_credit"))
    parser.add_argument("--jobs", type=int, default=1)
    args = parser.parse_args()
    seeds = tuple(args.seeds)
    arms = list(dict.fromkeys(["gdpo", *args.arms]))
    command = "python benchmarks/step_credit.py --variants " + " ".join(args.variants) + " --arms " + " ".join(arms)
    if seeds != SEEDS:
        command += " --seeds " + " ".join(map(str, seeds))
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    for variant in args.variants:
        spec = variant_spec(variant)
        runs = [Run(spec, ARMS[arm], seed, variant, arm) for seed in seeds for arm in arms]
        results = run_all(runs, args.work_dir, jobs=args.jobs)
        markdown, summary = report(variant, arms, seeds, results, runs, command, title="Step-level credit rules")
        save_report(output, variant, markdown, summary)


if __name__ == "__main__":
    main()
