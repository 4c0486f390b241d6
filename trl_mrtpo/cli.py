"""The ``trl-mrtpo`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from .demo import DEMO_TASKS


def _pin_threads(threads: int | None) -> None:
    import torch

    threads = threads or os.cpu_count() or 1
    torch.set_num_threads(threads)


def _print_curves(log_history: list[dict], reward_names: Sequence[str]) -> None:
    """Per-step reward means and MRTPO metrics as a plain table."""
    columns = [f"rewards/{name}/mean" for name in reward_names] + [
        "mrtpo/beta",
        "mrtpo/replayed_fraction",
        "mrtpo/cap_factor",
        "mrtpo/replay_share",
    ]
    rows = [h for h in log_history if "mrtpo/beta" in h]
    headers = ["step"] + [c.split("/")[1] if c.startswith("rewards/") else c.split("/")[1] for c in columns]
    print("  ".join(f"{h:>16}" for h in headers))
    for h in rows:
        cells = [f"{h.get('step', 0):>16}"]
        for c in columns:
            value = h.get(c)
            cells.append(f"{value:>16.3f}" if isinstance(value, (int, float)) else f"{'n/a':>16}")
        print("  ".join(cells))


def run_demo(args: argparse.Namespace):
    """Run the demo and return the trainer."""
    _pin_threads(args.threads)
    from peft import LoraConfig

    from . import MRTPOConfig, MRTPOTrainer
    from .demo import demo_task
    from .embedded import cache_root, embedded_model_path

    print("Loading the embedded SmolLM2-135M-Instruct (first run converts the GGUF, ~30 s)...", flush=True)
    model_path = embedded_model_path()
    rewards, info_blocks, dataset = demo_task(
        args.task, num_prompts=max(args.steps, 8), seed=args.seed, cache_dir=str(cache_root() / "demo_sql")
    )
    config = MRTPOConfig(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=args.seed,
        credit_warmup_steps=args.warmup_steps,
        bf16=False,  # bf16 autocast on CPU runs the matmuls several times slower
        disable_tqdm=False,
    )
    trainer = MRTPOTrainer(
        model=model_path,
        reward_funcs=rewards,
        info_blocks=info_blocks,
        args=config,
        train_dataset=dataset,
        peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    )
    trainer.train()
    print("\nPer-step rewards and MRTPO metrics:")
    _print_curves(trainer.state.log_history, trainer.reward_func_names)
    trainer.save_model(args.output_dir)
    trainer.create_model_card(model_name=f"{os.path.basename(model_path)}-MRTPO-demo-{args.task}")
    print(f"\nAdapter and model card saved to {args.output_dir}")
    return trainer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trl-mrtpo", description="Reward-specific token-level credit (MRTPO) for TRL."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="Train a LoRA adapter with MRTPO on the embedded SmolLM2-135M-Instruct, on CPU (a few minutes)."
    )
    demo.add_argument(
        "--task",
        choices=DEMO_TASKS,
        default="basic",
        help="basic: 3 constraint rewards + length (default); sql: text-to-SQL kit; if: instruction following "
        "(13 constraint slots); tools: tool calling",
    )
    demo.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    demo.add_argument("--num-generations", type=int, default=4, help="responses per prompt (default 4)")
    demo.add_argument("--max-completion-length", type=int, default=48, help="tokens per response (default 48)")
    demo.add_argument("--learning-rate", type=float, default=5e-5, help="LoRA learning rate (default 5e-5)")
    demo.add_argument("--warmup-steps", type=int, default=5, help="credit_beta warm-up steps (default 5)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    demo.add_argument("--output-dir", default="mrtpo-demo", help="where the adapter and model card go")
    demo.set_defaults(func=run_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
