"""The agent A/B kit for one GPU: MRTPO against GDPO on the `agent` task, as benchmarks/agent_ab_protocol.md fixes it.

    python benchmarks/agent_ab.py run --output agent_ab        # 2 arms x 3 seeds (a finished run is kept)
    python benchmarks/agent_ab.py analyse agent_ab             # endpoint.md, curves.csv
    python benchmarks/agent_ab.py run --dry-run --output DIR   # 2 steps per arm, a tiny Qwen3 on the CPU

Each run is ``trl-mrtpo train --config RECIPE --seed S --credit_assignment ARM --output_dir OUTPUT/ARM-seedS``
(under ``accelerate launch`` with TRL's single-GPU config on a GPU); its ``trainer_state.json`` holds the logged
metrics the analysis reads.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "vllm" / "agent-qwen3-4b-instruct-2507-lora-colocate.yaml"
ARMS = ("mrtpo", "gdpo")
SEEDS = (0, 1, 2)
PRIMARY = "rewards/agent_answer_reward/mean"
SECONDARY = ("rewards/agent_format_reward/mean", "rewards/agent_call_reward/mean")
WINDOW = 40  # the last logged steps the endpoint averages
PROTOCOL_STEPS = 200  # the logged training steps of a run the protocol fixes


def run_folder(output: Path, arm: str, seed: int) -> Path:
    return output / f"{arm}-seed{seed}"


def command(output: Path, arm: str, seed: int, dry_run: bool) -> list[str]:
    """The training command of one run (the dry run: a tiny random Qwen3, 2 steps, no vLLM, CPU)."""
    args = ["--config", str(RECIPE), "--seed", str(seed), "--credit_assignment", arm]
    args += ["--output_dir", str(run_folder(output, arm, seed))]
    if dry_run:
        args += ["--model_name_or_path", str(output / "tiny-qwen3"), "--max_steps", "2", "--use_vllm", "false",
                 "--use_cpu", "true", "--bf16", "false", "--dtype", "float32", "--max_completion_length", "16",
                 "--per_device_train_batch_size", "4", "--num_generations", "4", "--gradient_accumulation_steps",
                 "1", "--activation_checkpointing", "false", "--threads", "1"]  # fmt: skip
        return [sys.executable, "-m", "trl_mrtpo.scripts.cli", "train", *args]
    return [sys.executable, "-m", "trl_mrtpo.scripts.cli", "train", "--accelerate_config", "single_gpu", *args]


def tiny_qwen3(folder: Path) -> None:
    """A random 2-layer Qwen3 with TRL's Qwen3 template and special tokens, for the dry run."""
    sys.path.insert(0, str(ROOT))
    from tests.test_recipes_as_written import family_model_dir

    family_model_dir("Qwen/Qwen3-4B-Instruct-2507", "float32", folder)


def run(output: Path, dry_run: bool) -> None:
    output.mkdir(parents=True, exist_ok=True)
    if dry_run and not (output / "tiny-qwen3" / "config.json").is_file():
        tiny_qwen3(output / "tiny-qwen3")
    for seed in SEEDS[:1] if dry_run else SEEDS:
        for arm in ARMS:
            if (run_folder(output, arm, seed) / "trainer_state.json").is_file():
                print(f"{arm} seed {seed}: done, kept")
                continue
            print(f"{arm} seed {seed}: " + " ".join(command(output, arm, seed, dry_run)), flush=True)
            subprocess.run(command(output, arm, seed, dry_run), cwd=ROOT, check=True)


def curves(output: Path) -> dict[tuple[str, int], list[dict]]:
    """Each finished run's logged training steps (``trainer_state.json``'s log history, steps with rewards)."""
    found = {}
    for arm in ARMS:
        for seed in SEEDS:
            state = run_folder(output, arm, seed) / "trainer_state.json"
            if state.is_file():
                history = json.loads(state.read_text())["log_history"]
                found[(arm, seed)] = [entry for entry in history if PRIMARY in entry]
    return found


def window_mean(steps: list[dict], key: str) -> float:
    """The mean of ``key`` over the last :data:`WINDOW` logged steps; NaN when one of them lacks it or is NaN."""
    values = [entry.get(key, math.nan) for entry in steps[-WINDOW:]]
    return statistics.fmean(values) if values else math.nan


def analyse(output: Path) -> str:
    """``endpoint.md`` (the primary endpoint per seed and its verdict, then the secondary measures) and
    ``curves.csv``; returns the markdown."""
    runs = curves(output)
    if not runs:
        raise SystemExit(f"{output}: no finished run (trainer_state.json) to analyse")
    with open(output / "curves.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["arm", "seed", "step", PRIMARY, *SECONDARY])
        for (arm, seed), steps in sorted(runs.items()):
            for entry in steps:
                writer.writerow([arm, seed, entry.get("step"), *(entry.get(k) for k in (PRIMARY, *SECONDARY))])
    paired = [seed for seed in SEEDS if all((arm, seed) in runs for arm in ARMS)]
    lines = ["# Agent A/B: the primary endpoint (benchmarks/agent_ab_protocol.md)", "",
             f"Mean of `{PRIMARY}` over the last {WINDOW} logged steps, per run.", "",
             "| seed | mrtpo | gdpo | mrtpo - gdpo |", "|---|---|---|---|"]  # fmt: skip
    differences = []
    for seed in paired:
        mrtpo, gdpo = (window_mean(runs[(arm, seed)], PRIMARY) for arm in ARMS)
        differences.append(mrtpo - gdpo)
        lines.append(f"| {seed} | {mrtpo:.3f} | {gdpo:.3f} | {mrtpo - gdpo:+.3f} |")
    short = [f"{arm}-seed{seed} ({len(steps)})" for (arm, seed), steps in sorted(runs.items())
             if len(steps) < PROTOCOL_STEPS]  # fmt: skip
    missing = [f"{arm}-seed{seed}" for (arm, seed), steps in sorted(runs.items())
               if not math.isfinite(window_mean(steps, PRIMARY))]  # fmt: skip
    verdict = (
        f"no data: {', '.join(short)} logged fewer training steps than the protocol's {PROTOCOL_STEPS}"
        if short
        else f"no data: `{PRIMARY}` is missing or NaN in {', '.join(missing)}"
        if missing
        else "incomplete: not every seed has both arms"
        if len(paired) < len(SEEDS)
        else "MRTPO helps (positive on every seed)"
        if all(d > 0 for d in differences)
        else "no: MRTPO is not ahead on every seed"
    )
    lines += ["", f"Verdict: {verdict}.", "", "Secondary (the same window):", ""]
    for key in SECONDARY:
        for seed in paired:
            values = [window_mean(runs[(arm, seed)], key) for arm in ARMS]
            lines.append(f"- `{key}`, seed {seed}: mrtpo {values[0]:.3f}, gdpo {values[1]:.3f}")
    text = "\n".join(lines) + "\n"
    (output / "endpoint.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    running = sub.add_parser("run")
    running.add_argument("--output", default="agent_ab")
    running.add_argument("--dry-run", action="store_true")
    analysing = sub.add_parser("analyse")
    analysing.add_argument("output")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(Path(args.output), args.dry_run)
        print(analyse(Path(args.output)))
    else:
        print(analyse(Path(args.output)))


if __name__ == "__main__":
    main()
