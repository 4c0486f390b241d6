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
import sys
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


def prm_share(seed: int, work_dir: str, num_prompts: int = 32, group: int = 8) -> str:
    """How large the oracle PRM's process part is next to the outcome part on the supervised policy's own samples
    (before any RL): the token-level std of each, and the process part's share of the variance of their sum."""
    import torch

    from trl_mrtpo.credit import group_advantages
    from trl_mrtpo.gym.runs import gym_dataset, sample_words
    from trl_mrtpo.gym.task import oracle_process_reward, row_constraints, supervised_policy
    from trl_mrtpo.steps.credit import process_advantages

    spec = variant_spec("default")
    model, tokenizer = supervised_policy(spec, seed, Path(work_dir) / "policies")
    rows = gym_dataset(spec, num_prompts, seed).to_list()
    texts, constraints = [], []
    for row in rows:
        for words in sample_words(model, tokenizer, row["prompt"][-1]["content"], spec.length, group, "cpu"):
            texts.append(" ".join(words))
            constraints.append(row["constraints"])
    rewards = torch.tensor(
        [[float(c.satisfied(t.split())) for c in row_constraints(r)] for t, r in zip(texts, constraints)]
    )
    outcome = group_advantages(rewards, group)[0].sum(-1).double()[:, None].expand(-1, spec.length)
    steps = oracle_process_reward(spec.length)(completions=texts, constraints=constraints)
    scores = torch.tensor([[score for _, _, score in s] for s in steps], dtype=torch.float64)
    ends = torch.arange(spec.length).expand_as(scores)
    process = process_advantages(scores, ends, group, spec.length)
    return (
        f"Oracle PRM on the supervised policy of seed {seed} ({num_prompts} prompts x {group} samples): token std of "
        f"the outcome part {outcome.std().item():.2f}, of the process part {process.std().item():.2f}; the process "
        f"part is {(process.var() / (outcome + process).var()).item():.0%} of the variance of their sum. Mean step "
        f"score {scores.mean().item():.2f}; {(scores == 0).any(1).float().mean().item():.0%} of responses have a "
        "step scored 0.\n"
    )


def opsd_teacher(seed: int, work_dir: str, num_prompts: int = 32, group: int = 8) -> str:
    """What the supervised policy does as OPSD's teacher: its samples after the student's prompt and after the
    teacher's (the prompt, then the constraint sentences restated as OPSD's privileged context)."""
    from trl_mrtpo.gym.runs import SEPARATOR, gym_dataset, sample_words
    from trl_mrtpo.gym.task import row_constraints, supervised_policy

    spec = variant_spec("default")
    model, tokenizer = supervised_policy(spec, seed, Path(work_dir) / "policies")
    rows = gym_dataset(spec, num_prompts, seed).to_list()
    lines = [f"Supervised policy of seed {seed}, {num_prompts} prompts x {group} samples, student and teacher:", ""]
    lines += ["| prompt | mean constraint reward | responses of the trained length |", "|---|---|---|"]
    for label, teacher in (("student's", False), ("teacher's (constraints restated)", True)):
        met, full, count = 0.0, 0, 0
        for row in rows:
            owned = row_constraints(row["constraints"])
            content = row["prompt"][-1]["content"]
            if teacher:  # SDFT's template: "{prompt}\n\n{privileged_context}", the gym's blocks joined by SEPARATOR
                content += "\n\n" + SEPARATOR.join(c.span for c in owned)
            for words in sample_words(model, tokenizer, content, spec.length, group, "cpu"):
                met += sum(c.satisfied(words) for c in owned) / len(owned)
                full += len(words) == spec.length
                count += 1
        lines.append(f"| {label} | {met / count:.3f} | {full / count:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=["default"], choices=list(VARIANTS))
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--work-dir", default="gym_runs")
    parser.add_argument("--output-dir", default=str(HERE / "results" / "step_credit"))
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument(
        "--diagnose",
        type=int,
        metavar="SEED",
        help="only measure, on one seed's supervised policy, the oracle PRM's share and OPSD's teacher",
    )
    args = parser.parse_args()
    if args.diagnose is not None:
        text = prm_share(args.diagnose, args.work_dir) + "\n" + opsd_teacher(args.diagnose, args.work_dir)
        (Path(args.output_dir) / "diagnostics.md").write_text(f"`{' '.join(['python', *sys.argv])}`\n\n{text}")
        print(text)
        return
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
