"""Does MRTPO learn faster? GRPO, GDPO, MRTPO, the joint / shuffled ablations and OPSD (TRL's self-distillation with
the info blocks as privileged context, ``trl_mrtpo.baselines.opsd``) on the embedded model, on CPU.

For each task kit (``tools``: 2 rewards, ``if``: 5-13 constraint rewards), method and seed, one LoRA run of a fixed
number of steps on the kit's built-in data (built with ``--data-seed``); the run's seed sets sampling and the data
order, so every method sees the same prompts in the same order for a given seed. Recorded per step: every reward's
batch mean. Reported per task and method, as mean +- std over seeds:

- steps to threshold: the first step whose *tracked* reward (tools: the format reward; if: the mean of the
  constraint rewards) reaches ``--threshold`` (0.8, the paper's format-reward mark), or "not reached";
- final reward: the tracked reward averaged over the last 3 steps, and every reward's final mean (CSV);
- held-out evaluation before and after training (tools: BFCL simple_python AST accuracy; if: IFEval
  prompt-level strict accuracy), greedy, on the first ``--eval-limit`` prompts.

Runs are resumable: each run checkpoints every ``--save-steps`` in ``--work-dir/<task>/<method>/seed<k>`` and a
finished run leaves a ``result.json`` that later invocations reuse. Writes ``convergence_steps.csv`` (per step),
``convergence_summary.csv``, ``convergence.png`` and ``convergence.md`` (the table) in ``--output-dir``.

    python benchmarks/convergence.py                                   # full grid (hours on 2 CPU cores)
    python benchmarks/convergence.py --tasks if --methods gdpo mrtpo --seeds 0 1 2 --steps 12
    python benchmarks/convergence.py --quick                           # smoke run (CI)
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
from pathlib import Path

from trl_mrtpo.gym.stats import mean_std, steps_to_threshold

METHODS = ("grpo", "gdpo", "mrtpo", "joint", "shuffled", "opsd", "mrtpo+", "strength")
# mrtpo+ and strength: paper-MRTPO with options frozen on the gym's development seeds, each in its own committed file
CHOICES = {
    "mrtpo+": Path(__file__).parent / "calibrated_credit_choice.json",
    "strength": Path(__file__).parent / "reward_strength_choice.json",
}


def method_settings(method: str) -> dict:
    """The MRTPOConfig fields of a method: its credit_assignment and, for a frozen variant, its options (``mrtpo`` is
    the published rule, per-reward strength the frozen ``strength``: ``trl_mrtpo.research.config.arm_settings``)."""
    from trl_mrtpo.research.config import arm_settings

    if method in CHOICES:
        return {"credit_assignment": "mrtpo", **arm_settings(json.loads(CHOICES[method].read_text())["options"])}
    return {"credit_assignment": "gdpo" if method == "opsd" else method, **arm_settings({})}


TASKS = ("tools", "if", "short")
EVALUATIONS = {"tools": ("bfcl_simple_python", "ast_accuracy"), "if": ("ifeval", "prompt_strict")}


def tracked_reward(task: str, step_rewards: dict[str, float]) -> float:
    """The reward whose threshold crossing is reported: the format reward (tools) or the constraints' mean (if)."""
    if task == "tools":
        return step_rewards["tool_format_reward"]
    values = [v for v in step_rewards.values() if not math.isnan(v)]
    return statistics.mean(values) if values else math.nan


def evaluate(model, tokenizer, task: str, limit: int, max_new_tokens: int) -> float:
    """Held-out benchmark score; NaN for a task without one (``short``: its training rewards are the measure)."""
    if task not in EVALUATIONS:
        return math.nan
    from trl_mrtpo.scripts.evaluation import evaluate as run_benchmark
    from trl_mrtpo.scripts.evaluation import transformers_generator

    generate = transformers_generator(model, tokenizer, max_new_tokens=max_new_tokens)
    benchmark, metric = EVALUATIONS[task]
    return run_benchmark(generate, benchmark, limit=limit).metrics[metric]


def baseline_evaluation(task: str, args: argparse.Namespace) -> float:
    """Held-out score of the untrained model (greedy, so one per task), cached in the work dir."""
    if task not in EVALUATIONS:  # nothing to score: do not load the model
        return math.nan
    path = Path(args.work_dir) / task / f"baseline_eval_{args.eval_limit}_{args.eval_max_new_tokens}.json"
    if path.exists():
        return json.loads(path.read_text())["score"]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_mrtpo.scripts.embedded import embedded_model_path

    name = args.model or embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(name, dtype="auto").to("cuda" if args.gpu else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(name)
    score = evaluate(model, tokenizer, task, args.eval_limit, args.eval_max_new_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"score": score}))
    return score


def train_run(task: str, method: str, seed: int, args: argparse.Namespace) -> dict:
    """One (task, method, seed) run, resumed from its last checkpoint if there is one."""
    run_dir = Path(args.work_dir) / task / method / f"seed{seed}"
    result_path = run_dir / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())

    from trl_mrtpo.baselines.opsd import opsd_config, opsd_trainer_class
    from trl_mrtpo.kits import get_kit
    from trl_mrtpo.scripts.demo import cpu_run_config, embedded_lora_config, embedded_lora_trainer
    from trl_mrtpo.scripts.embedded import embedded_model_path

    kit = get_kit(task)
    rewards, info_blocks = kit.rewards, kit.info_blocks
    dataset = kit.dataset(num_prompts=args.steps * args.batch_size, seed=args.data_seed)
    config = cpu_run_config(
        str(run_dir),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        temperature=args.temperature,
        seed=seed,
        use_cpu=not args.gpu,
        bf16=args.gpu,
        **method_settings(method),
        credit_warmup_steps=args.warmup_steps,
        save_strategy="steps",
        save_steps=args.save_steps,
        disable_tqdm=True,
    )
    if method == "opsd":  # TRL's self-distillation, the info blocks as privileged context, same shared settings
        trainer = opsd_trainer_class()(
            args.model or embedded_model_path(),
            rewards,
            info_blocks,
            opsd_config(config),
            dataset,
            peft_config=embedded_lora_config(),
        )
    else:
        trainer = embedded_lora_trainer(rewards, info_blocks, config, dataset, model=args.model)
    resume = any(run_dir.glob("checkpoint-*"))
    print(f"{task}/{method}/seed{seed}: {'resuming' if resume else 'training'} ({args.steps} steps)", flush=True)
    trainer.train(resume_from_checkpoint=resume or None)
    per_step = [
        {name: _number(entry.get(f"rewards/{name}/mean")) for name in trainer.reward_func_names}
        for entry in trainer.state.log_history
        if any(key.startswith("rewards/") for key in entry)
    ]
    result = {
        "task": task,
        "method": method,
        "seed": seed,
        "rewards": per_step,
        "eval_after": evaluate(
            trainer.model, trainer.processing_class, task, args.eval_limit, args.eval_max_new_tokens
        ),
    }
    result_path.write_text(json.dumps(result))
    return result


def reuse_recorded_runs(path: str, args: argparse.Namespace) -> int:
    """Seeds the work dir with the runs a previous ``convergence_steps.csv`` recorded (every reward's mean per step),
    so a grid can grow by one method without recomputing the others. The CSV holds no held-out score: a reused run
    has none (NaN). Returns how many runs were written; runs already in the work dir are left alone."""
    runs: dict[tuple[str, str, int], dict[int, dict[str, float]]] = {}
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            key = (row["task"], row["method"], int(row["seed"]))
            runs.setdefault(key, {}).setdefault(int(row["step"]), {})[row["reward"]] = float(row["mean"])
    written = 0
    for (task, method, seed), steps in runs.items():
        result_path = Path(args.work_dir) / task / method / f"seed{seed}" / "result.json"
        if result_path.exists():
            continue
        result_path.parent.mkdir(parents=True, exist_ok=True)
        rewards = [steps[step] for step in sorted(steps)]
        record = {"task": task, "method": method, "seed": seed, "rewards": rewards, "eval_after": math.nan}
        result_path.write_text(json.dumps(record))
        written += 1
    return written


def _number(value: float | None) -> float:
    """A logged mean, NaN when TRL logged None (a reward that applied to no sample of the batch)."""
    return math.nan if value is None else float(value)


def run_final(run: dict, name: str, window: int) -> float:
    """One run's final value of reward ``name``: its mean over the last ``window`` steps (NaN when a step of the
    window is NaN; the tables and the paired comparison leave such a run out)."""
    return statistics.fmean(step[name] for step in run["rewards"][-window:])


def final_per_reward(runs: list[dict], window: int) -> dict[str, float]:
    """Every reward's mean over the last steps, averaged over seeds (NaN-free)."""
    names = runs[0]["rewards"][0]
    finals = {}
    for name in names:
        values = [run_final(r, name, window) for r in runs]
        values = [v for v in values if not math.isnan(v)]
        if values:
            finals[name] = round(statistics.fmean(values), 4)
    return finals


def summarise(results: list[dict], baselines: dict[str, float], args: argparse.Namespace) -> list[dict]:
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "convergence_steps.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "method", "seed", "step", "reward", "mean"])
        for r in results:
            for step, rewards in enumerate(r["rewards"], start=1):
                for name, value in rewards.items():
                    writer.writerow([r["task"], r["method"], r["seed"], step, name, value])
    summary = []
    for task in args.tasks:
        for method in args.methods:
            runs = [r for r in results if r["task"] == task and r["method"] == method]
            curves = [[tracked_reward(task, step) for step in r["rewards"]] for r in runs]
            reached = [steps_to_threshold(curve, args.threshold, window=1) for curve in curves]
            summary.append(
                {
                    "task": task,
                    "method": method,
                    "seeds": len(runs),
                    "steps_to_threshold": mean_std([float(s + 1) for s in reached if s is not None]),  # 1-based
                    "runs_reaching_threshold": f"{sum(s is not None for s in reached)}/{len(runs)}",
                    "final_tracked_reward": mean_std([statistics.fmean(c[-args.final_window :]) for c in curves]),
                    "eval_before": "n/a" if math.isnan(baselines[task]) else f"{baselines[task]:.3f}",
                    "eval_after": mean_std([r["eval_after"] for r in runs]),
                    "final_per_reward": json.dumps(final_per_reward(runs, args.final_window)),
                }
            )
    with open(out_dir / "convergence_summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(summary[0]))
        writer.writeheader()
        writer.writerows(summary)
    lines = [
        f"| task | method | seeds | steps to {args.threshold} (runs reaching) | final tracked reward | "
        f"held-out before | held-out after |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {s['task']} | {s['method']} | {s['seeds']} | {s['steps_to_threshold']} ({s['runs_reaching_threshold']}) "
        f"| {s['final_tracked_reward']} | {s['eval_before']} | {s['eval_after']} |"
        for s in summary
    ]
    lines += paired_lines(results, args)
    for task in args.tasks:
        names = list(next(r for r in results if r["task"] == task)["rewards"][0])
        lines += [
            "",
            f"{task}: every reward, first step (untrained policy) -> mean of the last {args.final_window} steps, "
            "mean ± std over seeds",
            "",
            "| method | " + " | ".join(names) + " |",
            "|---|" + "---|" * len(names),
        ]
        for method in args.methods:
            runs = [r for r in results if r["task"] == task and r["method"] == method]
            cells = []
            for name in names:
                first = mean_std([r["rewards"][0][name] for r in runs])
                last = mean_std([run_final(r, name, args.final_window) for r in runs])
                cells.append(f"{first} -> {last}")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    (out_dir / "convergence.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(results, args, out_dir / "convergence.png")
    return summary


def paired_lines(results: list[dict], args: argparse.Namespace) -> list[str]:
    """Every method against gdpo, paired by seed, on the final tracked reward and on every reward's final mean (mean
    difference, W/T/L, exact Wilcoxon p; with 3 seeds the smallest possible p is 0.25, with 8 it is 0.008)."""
    from trl_mrtpo.gym.stats import paired

    if "gdpo" not in args.methods:
        return []
    lines = ["", "Against gdpo, paired by seed (final tracked reward, then each reward's final mean):", ""]
    lines += ["| task | method | measure | pairs | mean difference | W/T/L | p |", "|---|---|---|---|---|---|---|"]
    for task in args.tasks:
        runs = [r for r in results if r["task"] == task]
        names = list(runs[0]["rewards"][0]) if runs else []
        rows = [
            {
                "method": r["method"],
                "seed": r["seed"],
                "tracked": statistics.fmean(tracked_reward(task, s) for s in r["rewards"][-args.final_window :]),
                **{name: run_final(r, name, args.final_window) for name in names},
            }
            for r in runs
        ]
        for method in args.methods:
            if method == "gdpo":
                continue
            for measure in ("tracked", *names):
                c = paired(rows, method, "gdpo", measure)
                lines.append(
                    f"| {task} | {method} | {measure} | {c['pairs']} | {c['mean_difference']:+.3f} | "
                    f"{c['wins']}/{c['ties']}/{c['losses']} | {c['p_value']:.3f} |"
                )
    return lines


def plot(results: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Tracked reward per step, mean over seeds with a +-1 std band, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.tasks), figsize=(6 * len(args.tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], args.tasks):
        for method in args.methods:
            curves = [
                [tracked_reward(task, step) for step in r["rewards"]]
                for r in results
                if r["task"] == task and r["method"] == method
            ]
            if not curves:
                continue
            steps = range(1, min(len(c) for c in curves) + 1)
            columns = [[c[i - 1] for c in curves] for i in steps]
            mean = [statistics.fmean(col) for col in columns]
            std = [statistics.stdev(col) if len(col) > 1 else 0.0 for col in columns]
            ax.plot(steps, mean, label=method)
            ax.fill_between(steps, [m - d for m, d in zip(mean, std)], [m + d for m, d in zip(mean, std)], alpha=0.2)
        ax.axhline(args.threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{task}: {'format reward' if task == 'tools' else 'mean constraint reward'}")
        ax.set_xlabel("step")
        ax.set_ylim(-0.02, 1.02)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (the fixed budget)")
    parser.add_argument("--batch-size", type=int, default=8, help="completions per step")
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-completion-length", type=int, default=96)
    parser.add_argument("--learning-rate", type=float, default=5e-5)
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--warmup-steps", type=int, default=5, help="credit_beta warm-up steps")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the built-in data (the same for every run)")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--final-window", type=int, default=3, help="last steps averaged into the final reward")
    parser.add_argument("--eval-limit", type=int, default=40, help="held-out prompts per evaluation")
    parser.add_argument("--eval-max-new-tokens", type=int, default=256)
    parser.add_argument("--save-steps", type=int, default=5, help="checkpoint interval (resumable runs)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--work-dir", default="convergence_runs", help="checkpoints and per-run results")
    parser.add_argument("--model", default=None, help="a model folder or Hub id instead of the embedded SmolLM2")
    parser.add_argument("--gpu", action="store_true", help="train on the GPU in bf16 (default: CPU, fp32)")
    parser.add_argument(
        "--reuse-steps",
        default=None,
        help="a previous convergence_steps.csv: its runs join the grid without being recomputed (no held-out score)",
    )
    parser.add_argument("--output-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: 2 seeds, 2 steps, short completions, 2 held-out prompts (overrides those options)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.save_steps = args.seeds[:2], 2, 1
        args.batch_size, args.num_generations, args.max_completion_length = 4, 2, 12
        args.eval_limit, args.eval_max_new_tokens, args.warmup_steps = 2, 12, 1
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.reuse_steps:
        print(f"reused {reuse_recorded_runs(args.reuse_steps, args)} recorded runs from {args.reuse_steps}")
    # seed-major order: an interrupted grid already holds every method for its first seeds
    results = [
        train_run(task, method, seed, args) for task in args.tasks for seed in args.seeds for method in args.methods
    ]
    baselines = {task: baseline_evaluation(task, args) for task in args.tasks}
    return summarise(results, baselines, args)


if __name__ == "__main__":
    main()
