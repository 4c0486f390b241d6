"""The token advantages of every credit rule and term, three steps each on the tiny test model, and of the credit
gym's oracle arm (its q from a relevance provider), six steps on the quick gym: a fingerprint to compare two trees
bit for bit after a refactor (nothing may move).

    OMP_NUM_THREADS=1 python benchmarks/advantage_fingerprint.py --output new.pt          # in each tree
    python benchmarks/advantage_fingerprint.py --compare old.pt new.pt
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.getcwd())  # this tree's package and tests, ahead of an installed one

# arm -> configuration fields; MRTPOTrainer trains the arms its configuration holds, ResearchTrainer every arm
ARMS = {
    "mrtpo": dict(credit_assignment="mrtpo", reward_strength_floor=0.003),
    "gdpo": dict(credit_assignment="gdpo"),
    "joint": dict(credit_assignment="joint"),
    "shuffled": dict(credit_assignment="shuffled"),
    "cort": dict(credit_assignment="cort"),
    "saw": dict(credit_assignment="mrtpo", reward_weighting="saw"),
    "concur": dict(credit_assignment="mrtpo", reward_weighting="concur"),
    "taco": dict(credit_assignment="mrtpo", taco_strength=0.5),
    "null": dict(credit_assignment="mrtpo", relevance_null_correction=True),
    "preserve": dict(credit_assignment="joint", preserve_reward_totals=True),
}
CORE_ARMS = ("mrtpo", "gdpo")


def fingerprint(work_dir: Path) -> dict[str, list[torch.Tensor]]:
    from tests.conftest import build_tiny_model, build_tiny_tokenizer
    from tests.helpers import graded_length, make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset
    from trl_mrtpo.research import ResearchTrainer

    tokenizer, out = build_tiny_tokenizer(), {}
    for name, settings in ARMS.items():
        for base in (ResearchTrainer, MRTPOTrainer) if name in CORE_ARMS else (ResearchTrainer,):
            seen = []

            class Recording(base):
                def _generate_and_score_completions(self, inputs, seen=seen):
                    output = super()._generate_and_score_completions(inputs)
                    seen.append(output["advantages"].clone())
                    return output

            args = make_args(
                work_dir / name,
                research=base is ResearchTrainer,
                max_steps=3,
                per_device_train_batch_size=8,
                num_generations=4,
                **settings,
            )
            Recording(
                model=build_tiny_model(tokenizer),
                reward_funcs=[graded_length, *BASIC.rewards],
                info_blocks=[lambda **_: "Be long.", *BASIC.info_blocks],
                args=args,
                train_dataset=make_basic_dataset(16),
                processing_class=tokenizer,
            ).train()
            out[f"{base.__name__}/{name}"] = seen
    return out


def gym_oracle_fingerprint(work_dir: Path) -> dict[str, list[torch.Tensor]]:
    """The gym's oracle arm, static and SAW weighting, on the quick gym's policy (seed 0)."""
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.gym.runs import RunSettings, train_run
    from trl_mrtpo.gym.task import GymSpec

    out, generate = {}, MRTPOTrainer._generate_and_score_completions
    for weighting in ("static", "saw"):
        seen = []

        def recording(self, inputs, seen=seen):
            output = generate(self, inputs)
            seen.append(output["advantages"].clone())
            return output

        MRTPOTrainer._generate_and_score_completions = recording  # the gym builds its trainer itself
        try:
            settings = RunSettings(
                method="oracle", steps=6, prompts_per_step=4, num_generations=4, credit_warmup_steps=2,
                reward_weighting=weighting,
            )  # fmt: skip
            spec = GymSpec(sft_teach_steps=80, sft_calibrate_steps=20)
            train_run(spec, settings, 0, work_dir / "gym_policies", work_dir / f"gym_oracle_{weighting}")
        finally:
            MRTPOTrainer._generate_and_score_completions = generate
        out[f"gym/oracle/{weighting}"] = seen
    return out


def compare(old: dict, new: dict) -> list[str]:
    """One line per arm: equal bit for bit, or the largest difference."""
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in old or key not in new:
            lines.append(f"{key}: only in {'new' if key in new else 'old'}")
            continue
        equal = len(old[key]) == len(new[key]) and all(torch.equal(a, b) for a, b in zip(old[key], new[key]))
        largest = max((float((a - b).abs().max()) for a, b in zip(old[key], new[key])), default=float("nan"))
        lines.append(f"{key}: {'identical' if equal else f'differs (max {largest:.3g})'}, {len(new[key])} steps")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="write this tree's fingerprint here")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"), help="compare two fingerprints")
    parser.add_argument("--work-dir", default="/tmp/advantage_fingerprint")
    args = parser.parse_args(argv)
    if args.compare:
        lines = compare(*(torch.load(path) for path in args.compare))
        print("\n".join(lines))
        sys.exit(0 if all("identical" in line for line in lines) else 1)
    torch.set_num_threads(1)
    work_dir = Path(args.work_dir)
    torch.save({**fingerprint(work_dir), **gym_oracle_fingerprint(work_dir)}, args.output)


if __name__ == "__main__":
    main()
