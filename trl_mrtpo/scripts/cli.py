"""The ``trl-mrtpo`` command: parses its arguments and calls the library (``demo``, ``eval``, ``inspect``, ``gym``,
``train``); every computation lives in the module it names."""

from __future__ import annotations

import argparse
import inspect
import sys
from collections.abc import Sequence

from ..constants import CREDIT_ASSIGNMENTS
from ..kits import SINGLE_TURN_KITS
from ..research.config import RESEARCH_CREDIT_ASSIGNMENTS
from . import DEMO_SETTINGS
from .evaluation import BENCHMARKS

THREADS_HELP = "torch threads (default: the free cores: usable cores minus the 1-minute load average, at least 1)"


def counting(minimum: int):
    """An argparse type for a count of at least ``minimum``; argparse names the flag in the error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive = counting(1)


def add_shared(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--threads`` and ``--overwrite``, which every command that loads a model and writes takes."""
    parser.add_argument("--model", default="embedded", help="'embedded' (default: SmolLM2-135M-Instruct, offline), "
                        "a Hub id or a local folder")  # fmt: skip
    parser.add_argument("--threads", type=positive, default=None, help=THREADS_HELP)
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace files or write into a non-empty folder that trl-mrtpo did not write (nothing else is removed)",
    )


def _pin_threads(threads: int | None) -> None:
    import torch

    from . import default_threads

    torch.set_num_threads(threads or default_threads())


def flags_for(function, args: argparse.Namespace, *leave_out: str) -> dict:
    """The parsed flags ``function`` takes as keyword arguments (a flag's ``-`` is a ``_`` in both)."""
    names = set(inspect.signature(function).parameters) - set(leave_out)
    return {name: value for name, value in vars(args).items() if name in names}


def in_usage_line(args: argparse.Namespace, run, *refusals: type[Exception]):
    """``run()``, with an output it would not overwrite (checked before anything loads) and ``refusals`` ending in the
    command's usage line, as a bad flag does."""
    from ..outputs import OutputRefused

    try:
        return run()
    except (OutputRefused, *refusals) as refused:
        args.parser.error(str(refused))


def run_demo(args: argparse.Namespace):
    from .demo import compare_demo, run_demo

    _pin_threads(args.threads)
    settings = flags_for(run_demo, args, "method")  # compare_demo passes them on to run_demo
    return in_usage_line(
        args, lambda: compare_demo(**settings) if args.compare else run_demo(method=args.method, **settings)
    )


def run_eval(args: argparse.Namespace):
    from .evaluation import run_evaluation

    _pin_threads(args.threads)
    return in_usage_line(args, lambda: run_evaluation(**flags_for(run_evaluation, args)))


def run_inspect(args: argparse.Namespace):
    from .inspection import inspect_credit, inspected_task

    _pin_threads(args.threads)
    settings = flags_for(inspect_credit, args, "model", "task", "completions")
    if settings.get("max_new_tokens") is None:  # a recipe's max_completion_length, else inspect_credit's 64
        settings.pop("max_new_tokens", None)
    # a mistake in the flags or the recipe ends in the usage line, before any model loads
    named = (args.config, args.model, args.task, args.adapter, args.completions)
    task = in_usage_line(args, lambda: inspected_task(*named), TypeError, ValueError, FileNotFoundError)
    return in_usage_line(args, lambda: inspect_credit(return_verdicts=True, verbose=True, **{**task, **settings}))


def run_gym(args: argparse.Namespace) -> str:
    from ..gym.report import run_gym_command

    _pin_threads(1)
    return run_gym_command(**flags_for(run_gym_command, args))


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
        choices=SINGLE_TURN_KITS,
        default=DEMO_SETTINGS["task"],
        help="short: short answers under 4 constraints (default); basic: 3 constraint rewards + length; sql: "
        "text-to-SQL kit; if: instruction following (13 constraint slots); tools: tool calling",
    )
    for flag, kind, what in (
        ("steps", positive, "optimizer steps"),
        ("num-generations", counting(2), "responses per prompt"),
        ("prompts-per-step", positive, "prompts per step"),
        ("max-completion-length", positive, "tokens per response"),
        ("learning-rate", float, "LoRA learning rate"),
        ("temperature", float, "sampling temperature"),
        ("warmup-steps", counting(0), "credit_beta warm-up steps"),
    ):
        default = DEMO_SETTINGS[flag.replace("-", "_")]
        demo.add_argument(f"--{flag}", type=kind, default=default, help=f"{what} (default {default})")
    demo.add_argument("--seed", type=int, default=0)
    add_shared(demo)
    demo.add_argument("--output-dir", default="mrtpo-demo", help="where the adapter, card, curves and heatmap go")
    demo.add_argument("--method", choices=("mrtpo", "gdpo"), default="mrtpo", help="credit assignment (default mrtpo)")
    demo.add_argument("--compare", action="store_true", help="gdpo then mrtpo on one task and seed, both plotted")
    demo.add_argument(
        "--report-to", default="none", help="trackers for the metrics and the heatmap (tensorboard, wandb, trackio)"
    )
    demo.set_defaults(func=run_demo, parser=demo)

    evaluate = sub.add_parser("eval", help="Evaluate a model on BFCL, IFEval, IFBench, Spider or BIRD.")
    evaluate.add_argument("--adapter", default=None, help="a LoRA adapter folder to apply (e.g. a demo output)")
    evaluate.add_argument(
        "--benchmarks", nargs="+", default=["bfcl_simple_python", "ifeval", "ifbench"], choices=BENCHMARKS
    )
    evaluate.add_argument("--limit", type=positive, default=None, help="first N prompts of each benchmark")
    evaluate.add_argument("--max-new-tokens", type=positive, default=256)
    evaluate.add_argument("--batch-size", type=positive, default=8)
    evaluate.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    evaluate.add_argument("--sql-path", default=None, help="Spider/BIRD folder")
    evaluate.add_argument("--sql-split-file", default=None, help="e.g. dev.json (Spider) or dev/dev.json (BIRD)")
    evaluate.add_argument("--database-dir", default="database", help="databases folder inside --sql-path")
    add_shared(evaluate)
    evaluate.add_argument("--output", default=None, help="write the results as JSON here")
    evaluate.set_defaults(func=run_eval, parser=evaluate)

    inspect = sub.add_parser(
        "inspect", help="Sample and replay a few prompts: token-credit heatmap (HTML) and localisation report."
    )
    inspect.add_argument("--adapter", default=None, help="a LoRA adapter folder to apply")
    inspect.add_argument("--task", choices=SINGLE_TURN_KITS, default="basic")
    inspect.add_argument(
        "--config",
        default=None,
        help="a training recipe (YAML, as `train --config` reads it): inspect its model (with --adapter applied), "
        "rewards, info blocks, process rewards, data, trainer and credit settings instead of --task/--model",
    )
    inspect.add_argument(
        "--completions",
        default=None,
        help="replay existing responses instead of sampling: JSONL, one line per response with prompt, completion "
        "and the row fields the task reads (those left out: the task's own row with that prompt; the same number "
        "of responses per prompt); a completion is a string, or a recorded tool trajectory (the messages TRL's "
        "tool loop produces), replayed through TRL's tool loop; 'example': the task kit's pass/fail pairs",
    )
    inspect.add_argument("--num-prompts", type=positive, default=4, help="prompts to sample (default 4)")
    inspect.add_argument("--num-generations", type=counting(2), default=4, help="responses per prompt (default 4)")
    inspect.add_argument(
        "--max-new-tokens",
        type=positive,
        default=None,
        help="tokens per response (default: a recipe's max_completion_length, else 64)",
    )
    inspect.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the recipe's, else 1.0)"
    )
    inspect.add_argument(
        "--beta", type=float, default=None, help="credit_beta for the weights shown (default: the recipe's, else 0.5)"
    )
    inspect.add_argument("--seed", type=int, default=0)
    add_shared(inspect)
    inspect.add_argument("--output", default="mrtpo-credit.html", help="the HTML page")
    inspect.add_argument("--report", default=None, help="write the localisation report as CSV here")
    inspect.set_defaults(func=run_inspect, parser=inspect)

    gym = sub.add_parser(
        "gym",
        help="Credit gym: every credit mode on a synthetic task whose relevant tokens are known, over several "
        "seeds, with paired statistics (about 15 minutes on 2 cores; --quick: about a minute).",
    )
    gym.add_argument("--quick", action="store_true", help="smoke-sized grid (CI)")
    gym.add_argument("--large", action="store_true", help="the GPU grid: 16 seeds, K=6, on CUDA (gpu_gym.sh)")
    gym.add_argument("--sweeps", action="store_true", help="also run the gdpo vs mrtpo sweeps (K, placement, ...)")
    gym.add_argument("--seeds", type=positive, default=None, help="number of seeds (default 8; --quick: 2)")
    gym.add_argument("--sweep-seeds", type=positive, default=4, help="seeds per sweep point (default 4)")
    methods = (*CREDIT_ASSIGNMENTS, *RESEARCH_CREDIT_ASSIGNMENTS)
    gym.add_argument("--methods", nargs="+", default=None, choices=methods, help="default: all six modes")
    gym.add_argument("--jobs", type=positive, default=2, help="parallel runs, one core each (default 2)")
    gym.add_argument("--work-dir", default="gym_runs", help="finished runs and cached supervised policies (resumable)")
    gym.add_argument("--output-dir", default="gym_results", help="CSV, PNG and markdown results (default gym_results)")
    gym.set_defaults(func=run_gym)

    sub.add_parser(
        "train",
        add_help=False,
        help="Train from a YAML recipe: trl-mrtpo train --config recipes/<task>/<model>.yaml [--any_field value]",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # TrlParser owns every flag of `train`, --help included
        from .train import launch_train, make_parser, run

        if "--help" in argv or "-h" in argv:
            make_parser().print_help()
            print("\n  --accelerate_config NAME   run under accelerate launch with a config TRL ships (single_gpu,")
            print("                             multi_gpu, zero1-3, fsdp1, fsdp2) or a config file")
            return
        if "--accelerate_config" in argv:
            launch_train(argv[1:])
            return
        run(argv[1:])
        return
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
