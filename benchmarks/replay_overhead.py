"""MRTPO's extra cost per optimizer step: MRTPO vs GDPO (and GRPO) step time on the embedded model, on CPU.

Every method runs in its own subprocess (same seed, same data order, torch pinned to ``--threads``), with
``learning_rate=0`` by default so that all methods sample exactly the same completions at every step and the only
difference is the credit assignment (the replay, for MRTPO). ``credit_warmup_steps=0`` so MRTPO replays from the
first step. The first step (start-up) is dropped from the means. Writes
``benchmarks/results/replay_overhead_cpu.csv`` (one row per method and step) and prints a table.

    python benchmarks/replay_overhead.py                          # basic and if tasks, 6 steps
    python benchmarks/replay_overhead.py --tasks if --steps 4 --methods gdpo mrtpo
    python benchmarks/replay_overhead.py --methods gdpo mrtpo mrtpo+strength   # with per-reward strength (resting)

``mrtpo`` is the published rule; a method ``mrtpo+<option>`` is MRTPO with an option on: ``strength`` (per-reward
strength, the default of ``MRTPOConfig``), ``null``, ``preserve``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
OPTIONS = {
    "strength": "reward_strength",
    "null": "relevance_null_correction",
    "preserve": "preserve_reward_totals",
}


def run_method(task: str, method: str, steps: int, seed: int, args: argparse.Namespace) -> list[dict]:
    """Runs in the child process: per-step wall time and MRTPO metrics."""
    import time

    import torch
    from transformers import TrainerCallback

    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.research.config import arm_settings
    from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_trainer

    torch.set_num_threads(args.threads)
    kit = get_kit(task)
    rewards, info_blocks, dataset = kit.rewards, kit.info_blocks, kit.dataset(num_prompts=max(8, steps * 2), seed=seed)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.started = [], 0.0

        def on_step_begin(self, *_, **__):
            self.started = time.perf_counter()

        def on_step_end(self, *_, **__):
            self.seconds.append(time.perf_counter() - self.started)

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        config = cpu_run_config(
            output_dir,
            max_steps=steps,
            per_device_train_batch_size=args.batch_size,
            num_generations=args.num_generations,
            max_completion_length=args.max_completion_length,
            learning_rate=args.learning_rate,
            seed=seed,
            credit_assignment=method.split("+")[0],
            **arm_settings({OPTIONS[option]: True for option in method.split("+")[1:]}),
            credit_warmup_steps=0,
            disable_tqdm=True,
            use_cpu=args.device == "cpu",
            bf16=args.device == "cuda",  # bf16 on the GPU, like a real run
        )
        trainer = embedded_lora_trainer(rewards, info_blocks, config, dataset, callbacks=[timer], model=args.model)
        trainer.train()
    logs = [entry for entry in trainer.state.log_history if "completions/mean_length" in entry]
    return [
        {
            "task": task,
            "method": method,
            "step": step,
            "seconds": seconds,
            "mean_length": log.get("completions/mean_length"),
            "replay_seconds": log.get("mrtpo/replay_seconds", 0.0),
            "replayed_fraction": log.get("mrtpo/replayed_fraction", 0.0),
        }
        for step, (seconds, log) in enumerate(zip(timer.seconds, logs))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["basic", "if"])
    parser.add_argument("--methods", nargs="+", default=["grpo", "gdpo", "mrtpo"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=64)
    parser.add_argument("--learning-rate", type=float, default=0.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--model", default=None, help="a model folder instead of the embedded SmolLM2 (same tokenizer)"
    )
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--output", default=str(RESULTS / "replay_overhead_cpu.csv"))
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_method(*args.child, args.steps, args.seed, args)))
        return

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    rows = []
    for task in args.tasks:
        for method in args.methods:
            child = [sys.executable, __file__, "--child", task, method, *sys.argv[1:]]
            out = subprocess.run(child, capture_output=True, text=True, env=env)
            if out.returncode != 0:
                sys.exit(f"{task}/{method} failed:\n{out.stderr[-3000:]}")
            steps = json.loads(out.stdout.strip().splitlines()[-1])
            rows.extend(steps)
            timed = steps[1:]
            print(
                f"{task:>6} {method:>6}: {statistics.mean(r['seconds'] for r in timed):6.2f} s/step "
                f"(replay {statistics.mean(r['replay_seconds'] for r in timed):5.2f} s)",
                flush=True,
            )
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    with open(args.output, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"written to {args.output}\n")
    print("| task | method | s/step (mean over steps 2..n) | replay s/step | pairs replayed | vs GDPO |")
    print("|---|---|---|---|---|---|")
    for task in args.tasks:
        timed = {m: [r for r in rows if r["task"] == task and r["method"] == m][1:] for m in args.methods}
        mean = {m: statistics.mean(r["seconds"] for r in timed[m]) for m in args.methods}
        for method in args.methods:
            replay = statistics.mean(r["replay_seconds"] for r in timed[method])
            replayed = statistics.mean(r["replayed_fraction"] for r in timed[method])
            ratio = f"{mean[method] / mean['gdpo']:.3f}x" if "gdpo" in mean else "-"
            print(f"| {task} | {method} | {mean[method]:.2f} | {replay:.2f} | {replayed:.0%} | {ratio} |")


if __name__ == "__main__":
    main()
