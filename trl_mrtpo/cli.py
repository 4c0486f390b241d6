"""The ``trl-mrtpo`` command."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from trl import ScriptArguments

from .config import CREDIT_ASSIGNMENTS
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
    headers = ["step"] + [c.split("/")[1] for c in columns]
    print("  ".join(f"{h:>16}" for h in headers))
    for h in rows:
        cells = [f"{h.get('step', 0):>16}"]
        for c in columns:
            value = h.get(c)
            cells.append(f"{value:>16.3f}" if isinstance(value, (int, float)) else f"{'n/a':>16}")
        print("  ".join(cells))


def _load_policy(model: str, adapter: str | None):
    """``(model, tokenizer)`` for eval and inspect: a hub id, folder or 'embedded', plus an optional LoRA adapter."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import embedded_model_path

    model_path = embedded_model_path() if model == "embedded" else model
    tokenizer = AutoTokenizer.from_pretrained(adapter or model_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path)
    if adapter:
        from peft import PeftModel

        policy = PeftModel.from_pretrained(policy, adapter)
    return policy, tokenizer


def run_demo(args: argparse.Namespace):
    """Run the demo and return the trainer."""
    _pin_threads(args.threads)
    from .demo import cpu_run_config, demo_task, embedded_lora_trainer
    from .embedded import embedded_model_path

    print("Loading the embedded SmolLM2-135M-Instruct (first run converts the GGUF, ~30 s)...", flush=True)
    model_path = embedded_model_path()
    rewards, info_blocks, dataset = demo_task(args.task, num_prompts=max(args.steps, 8), seed=args.seed)
    config = cpu_run_config(
        args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        learning_rate=args.learning_rate,
        seed=args.seed,
        credit_warmup_steps=args.warmup_steps,
        disable_tqdm=False,
    )
    trainer = embedded_lora_trainer(rewards, info_blocks, config, dataset)
    trainer.train()
    print("\nPer-step rewards and MRTPO metrics:")
    _print_curves(trainer.state.log_history, trainer.reward_func_names)
    trainer.save_model(args.output_dir)
    trainer.create_model_card(model_name=f"{os.path.basename(model_path)}-MRTPO-demo-{args.task}")
    print(f"\nAdapter and model card saved to {args.output_dir}")
    return trainer


@dataclass
class MRTPOScriptArguments(ScriptArguments):
    """Script arguments of ``trl-mrtpo train`` (beside MRTPOConfig and TRL's ModelConfig).

    Parameters:
        task (`str`, *optional*):
            Built-in task kit (`basic`, `sql`, `if`, `tools`): its rewards and info blocks, and its built-in data
            unless `dataset_name` or `data_loader` is given.
        reward_funcs (`list[str]`, *optional*):
            Reward functions by registry name (e.g. `sql_format_reward`) or dotted import path; overrides the task's.
        info_blocks (`list[str]`, *optional*):
            One info-block builder per reward: registry name, dotted path, or `none`.
        data_loader (`str`, *optional*):
            `spider`, `bird`, `hir` or `rlla`: read `data_path` with that kit adapter.
        data_path (`str`, *optional*):
            Folder, file or hub id for `data_loader`.
        data_split_file (`str`, *optional*):
            For `spider` / `bird`: the examples file inside `data_path` (e.g. `train_spider.json`).
        database_dir (`str`, *optional*, defaults to `"database"`):
            For `spider` / `bird`: the databases folder inside `data_path`.
    """

    task: str | None = field(default=None, metadata={"help": "Built-in task kit: basic, sql, if or tools."})
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Reward functions: registry names or dotted import paths."}
    )
    info_blocks: list[str] | None = field(
        default=None, metadata={"help": "One info-block builder per reward: registry name, dotted path or 'none'."}
    )
    data_loader: str | None = field(
        default=None, metadata={"help": "Kit adapter for data_path: spider, bird, hir or rlla."}
    )
    data_path: str | None = field(default=None, metadata={"help": "Folder, file or hub id read by data_loader."})
    data_split_file: str | None = field(
        default=None, metadata={"help": "spider/bird: examples file inside data_path, e.g. train_spider.json."}
    )
    database_dir: str = field(default="database", metadata={"help": "spider/bird: databases folder in data_path."})


def train_parser():
    from trl import ModelConfig, TrlParser

    from . import MRTPOConfig

    return TrlParser((MRTPOScriptArguments, MRTPOConfig, ModelConfig), prog="trl-mrtpo train")


def load_training_data(script_args: MRTPOScriptArguments, seed: int):
    """The train dataset a script configuration names (kit adapter, TRL dataset, or the task's built-in data)."""
    from datasets import Dataset, load_dataset

    from .demo import builtin_dataset

    loader = script_args.data_loader
    if loader in ("spider", "bird"):
        from .reward_funcs.sql import load_spider_or_bird

        if not script_args.data_path or not script_args.data_split_file:
            raise ValueError(f"data_loader={loader} needs data_path and data_split_file")
        rows = load_spider_or_bird(script_args.data_path, script_args.data_split_file, script_args.database_dir)
        return Dataset.from_list(rows)
    if loader == "hir":
        from .reward_funcs.instruction_following import load_hir

        return load_hir(script_args.data_path or "sastpg/HIR-16K")
    if loader == "rlla":
        from .reward_funcs.tool_calling import load_rlla

        if not script_args.data_path:
            raise ValueError("data_loader=rlla needs data_path (a parquet/JSON file or a hub id)")
        return load_rlla(script_args.data_path)
    if loader is not None:
        raise ValueError(f"unknown data_loader {loader!r}; choose spider, bird, hir or rlla")
    if script_args.dataset_name:
        return load_dataset(script_args.dataset_name, name=script_args.dataset_config)[script_args.dataset_train_split]
    if script_args.task:
        return builtin_dataset(script_args.task, num_prompts=256, seed=seed)
    raise ValueError("no training data: set task, dataset_name or data_loader")


def build_trainer(script_args: MRTPOScriptArguments, training_args, model_args):
    """The MRTPOTrainer a recipe describes (``model_name_or_path: embedded`` is the embedded SmolLM2)."""
    from trl import get_peft_config

    from . import MRTPOTrainer
    from .demo import task_kit
    from .embedded import embedded_model_path
    from .registry import resolve

    rewards, blocks = task_kit(script_args.task) if script_args.task else ([], [])
    if script_args.reward_funcs:
        rewards = [resolve(name, "reward") for name in script_args.reward_funcs]
        blocks = [None] * len(rewards)
    if script_args.info_blocks:
        blocks = [resolve(name, "info_block") for name in script_args.info_blocks]
    if not rewards:
        raise ValueError("no reward functions: set task or reward_funcs")
    model = model_args.model_name_or_path
    if model is None:
        raise ValueError("model_name_or_path is required (a hub id, a local folder, or 'embedded')")
    if model == "embedded":
        model = embedded_model_path()
    if model_args.dtype not in (None, "auto"):
        training_args.model_init_kwargs = {**(training_args.model_init_kwargs or {}), "dtype": model_args.dtype}
    return MRTPOTrainer(
        model=model,
        reward_funcs=rewards,
        info_blocks=blocks,
        args=training_args,
        train_dataset=load_training_data(script_args, training_args.seed),
        peft_config=get_peft_config(model_args),
    )


def run_train(argv: Sequence[str]) -> None:
    script_args, training_args, model_args = train_parser().parse_args_and_config(list(argv))
    trainer = build_trainer(script_args, training_args, model_args)
    if "--config" in argv:
        trainer.recipe = argv[list(argv).index("--config") + 1]
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name=script_args.dataset_name or script_args.task)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)


def run_eval(args: argparse.Namespace) -> list:
    """Generate on each requested benchmark, print a table, write JSON; returns the results."""
    import json
    from dataclasses import asdict

    _pin_threads(args.threads)
    from . import evaluation
    from .embedded import embedded_model_path

    if args.backend == "vllm":
        if args.adapter:
            raise ValueError("--adapter is not supported with --backend vllm: merge the adapter first")
        model_path = embedded_model_path() if args.model == "embedded" else args.model
        generate = evaluation.vllm_generator(model_path, args.max_new_tokens)
    else:
        model, tokenizer = _load_policy(args.model, args.adapter)
        model.eval()
        generate = evaluation.transformers_generator(model, tokenizer, args.max_new_tokens, args.batch_size)

    results = []
    for benchmark in args.benchmarks:
        print(f"Evaluating {benchmark} ...", flush=True)
        if benchmark.startswith("bfcl_"):
            results.append(evaluation.evaluate_bfcl(generate, benchmark[len("bfcl_") :], args.limit))
        elif benchmark in ("ifeval", "ifbench"):
            results.append(evaluation.evaluate_instruction_following(generate, benchmark, args.limit))
        elif benchmark in ("spider", "bird"):
            if not args.sql_path or not args.sql_split_file:
                raise ValueError(f"{benchmark} needs --sql-path and --sql-split-file (a local copy)")
            results.append(
                evaluation.evaluate_sql(generate, args.sql_path, args.sql_split_file, args.database_dir, args.limit)
            )
    print(evaluation.format_table(results))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "adapter": args.adapter, "limit": args.limit,
                       "results": [asdict(r) for r in results]}, f, indent=1)  # fmt: skip
        print(f"Results written to {args.output}")
    return results


def run_inspect(args: argparse.Namespace):
    """Sample, score and replay a few prompts; write the heatmap page and the localisation report."""
    import tempfile

    _pin_threads(args.threads)
    import torch
    from datasets import Dataset

    from . import MRTPOConfig, MRTPOTrainer
    from .demo import builtin_dataset, task_kit
    from .inspection import (
        control_block,
        control_reward,
        fixed_rollout,
        format_report,
        load_completions,
        localisation_report,
        sample_credit,
        with_control_sentence,
        write_report,
    )
    from .viz import credit_heatmap_html

    torch.manual_seed(args.seed)
    model, tokenizer = _load_policy(args.model, args.adapter)
    rewards, blocks = task_kit(args.task)
    rollout, num_generations = None, args.num_generations
    if args.completions:
        rows, completions, num_generations = load_completions(args.completions)
        rollout = fixed_rollout(completions)
    else:
        data = builtin_dataset(args.task, args.num_prompts, args.seed)
        rows = list(data.select(range(min(args.num_prompts, len(data)))))
    rows = [{**row, "prompt": with_control_sentence(row["prompt"])} for row in rows]
    config = MRTPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl-mrtpo-inspect-"),
        per_device_train_batch_size=len(rows) * num_generations,  # one generation batch holds them all
        num_generations=num_generations,
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        credit_beta=args.beta,
        credit_warmup_steps=0,
        replay_only_varying=False,  # show q for every reward with a block, varying or not
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        report_to="none",
        seed=args.seed,
    )
    trainer = MRTPOTrainer(
        model=model,
        reward_funcs=[*rewards, control_reward],
        info_blocks=[*blocks, control_block],
        args=config,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        rollout_func=rollout,
    )
    record = sample_credit(trainer, rows, num_generations)
    names = trainer.reward_func_names
    with open(args.output, "w", encoding="utf-8") as page:
        page.write(credit_heatmap_html(record, tokenizer, names, title=f"MRTPO token credit: {args.task} task"))
    print(f"Heatmap written to {args.output}")
    report = localisation_report(record, tokenizer, rows, args.task, names, num_generations)
    print(format_report(report))
    if args.report:
        write_report(report, args.report)
        print(f"Localisation report written to {args.report}")
    return record, report


def run_gym(args: argparse.Namespace) -> str:
    """Run (or resume) the gym grid and write its results; returns the markdown summary."""
    from .gym import Grid, large_grid, localisation, quick_grid, run_all, satisfaction
    from .gym.report import write_results

    _pin_threads(1)
    grid = quick_grid() if args.quick else large_grid() if args.large else Grid()
    if grid.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("trl-mrtpo gym --large needs a CUDA device; none is available here.")
    if args.seeds is not None:
        grid.seeds = tuple(range(args.seeds))
    if args.methods:
        grid.methods = tuple(args.methods)
    grid.sweep_seeds = args.sweep_seeds
    main_runs = grid.main_runs()
    sweep_runs = grid.sweep_runs() if args.sweeps else []
    results = run_all([*main_runs, *sweep_runs], args.work_dir, jobs=args.jobs, device=grid.device)
    policies = os.path.join(args.work_dir, "policies")
    located = [
        record
        for seed in grid.seeds
        for record in localisation(
            grid.spec, seed, policies, num_prompts=grid.localisation_prompts, device=grid.device
        )
    ]
    rates = [
        record
        for seed in grid.seeds
        for record in satisfaction(
            grid.spec, seed, policies, num_prompts=grid.localisation_prompts, device=grid.device
        )
    ]
    command = "trl-mrtpo gym" + "".join(f" --{flag}" for flag in ("quick", "large", "sweeps") if getattr(args, flag))
    if args.sweeps and args.sweep_seeds != 4:
        command += f" --sweep-seeds {args.sweep_seeds}"
    markdown = write_results(grid, main_runs, sweep_runs, results, located, args.output_dir, command, rates)
    print(markdown)
    return markdown


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
    from .evaluation import BFCL_CATEGORIES

    benchmarks = [f"bfcl_{c}" for c in BFCL_CATEGORIES] + ["ifeval", "ifbench", "spider", "bird"]
    evaluate = sub.add_parser("eval", help="Evaluate a model on BFCL, IFEval, IFBench, Spider or BIRD.")
    evaluate.add_argument("--model", default="embedded", help="hub id, local folder, or 'embedded' (default)")
    evaluate.add_argument("--adapter", default=None, help="a LoRA adapter folder to apply (e.g. a demo output)")
    evaluate.add_argument(
        "--benchmarks", nargs="+", default=["bfcl_simple_python", "ifeval", "ifbench"], choices=benchmarks
    )
    evaluate.add_argument("--limit", type=int, default=None, help="first N prompts of each benchmark")
    evaluate.add_argument("--max-new-tokens", type=int, default=256)
    evaluate.add_argument("--batch-size", type=int, default=8)
    evaluate.add_argument("--backend", choices=["transformers", "vllm"], default="transformers")
    evaluate.add_argument("--sql-path", default=None, help="Spider/BIRD folder")
    evaluate.add_argument("--sql-split-file", default=None, help="e.g. dev.json (Spider) or dev/dev.json (BIRD)")
    evaluate.add_argument("--database-dir", default="database", help="databases folder inside --sql-path")
    evaluate.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    evaluate.add_argument("--output", default=None, help="write the results as JSON here")
    evaluate.set_defaults(func=run_eval)
    inspect = sub.add_parser(
        "inspect", help="Sample and replay a few prompts: token-credit heatmap (HTML) and localisation report."
    )
    inspect.add_argument("--model", default="embedded", help="hub id, local folder, or 'embedded' (default)")
    inspect.add_argument("--adapter", default=None, help="a LoRA adapter folder to apply")
    inspect.add_argument("--task", choices=DEMO_TASKS, default="basic")
    inspect.add_argument(
        "--completions",
        default=None,
        help="replay existing responses instead of sampling: JSONL, one line per response with prompt, completion "
        "and the row fields the task reads (the same number of responses per prompt)",
    )
    inspect.add_argument("--num-prompts", type=int, default=4)
    inspect.add_argument("--num-generations", type=int, default=4)
    inspect.add_argument("--max-new-tokens", type=int, default=64)
    inspect.add_argument("--temperature", type=float, default=1.0)
    inspect.add_argument("--beta", type=float, default=0.5, help="credit_beta for the weights shown")
    inspect.add_argument("--seed", type=int, default=0)
    inspect.add_argument("--threads", type=int, default=None)
    inspect.add_argument("--output", default="mrtpo-credit.html", help="the HTML page")
    inspect.add_argument("--report", default=None, help="write the localisation report as CSV here")
    inspect.set_defaults(func=run_inspect)
    gym = sub.add_parser(
        "gym",
        help="Credit gym: every credit mode on a synthetic task whose relevant tokens are known, over several "
        "seeds, with paired statistics (about 15 minutes on 2 cores; --quick: about a minute).",
    )
    gym.add_argument("--quick", action="store_true", help="smoke-sized grid (CI)")
    gym.add_argument(
        "--large",
        action="store_true",
        help="the GPU grid: 16 seeds, K=6, a 4-layer policy of width 128, on CUDA (benchmarks/gpu_gym.sh)",
    )
    gym.add_argument("--sweeps", action="store_true", help="also run the gdpo vs mrtpo sweeps (K, placement, ...)")
    gym.add_argument("--seeds", type=int, default=None, help="number of seeds (default 8; --quick: 2)")
    gym.add_argument("--sweep-seeds", type=int, default=4, help="seeds per sweep point (default 4)")
    gym.add_argument("--methods", nargs="+", default=None, choices=CREDIT_ASSIGNMENTS, help="default: all six modes")
    gym.add_argument("--jobs", type=int, default=2, help="parallel runs, one core each (default 2)")
    gym.add_argument("--work-dir", default="gym_runs", help="finished runs and cached supervised policies (resumable)")
    gym.add_argument("--output-dir", default="benchmarks/results/credit_gym", help="CSV, PNG and markdown results")
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
        if "--help" in argv or "-h" in argv:
            train_parser().print_help()
            return
        run_train(argv[1:])
        return
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main(sys.argv[1:])
