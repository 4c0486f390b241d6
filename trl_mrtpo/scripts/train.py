"""``trl-mrtpo train``: train from a YAML recipe, in the shape of TRL's ``trl grpo`` script.

```bash
trl-mrtpo train --config recipes/sql/qwen2.5-coder-3b-instruct-lora.yaml [--any_field value]
```

Beside TRL's script it knows the task kits (``task``: their rewards, info blocks and built-in data; ``data_loader``:
their readers of published data) and one info-block builder per reward.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from trl import ScriptArguments

from ..chat_templates import chat_template
from ..checks.config import check_field_types
from ..kits import KIT_NAMES, data_loaders, get_kit, resolve


@dataclass
class MRTPOScriptArguments(ScriptArguments):
    """Script arguments of ``trl-mrtpo train`` (beside MRTPOConfig, TRL's ModelConfig and DatasetMixtureConfig).

    Parameters:
        task (`str`, *optional*):
            Task kit (`basic`, `sql`, `if`, `tools`, `short`): its rewards and info blocks, and its built-in data
            unless `dataset_name`, `datasets` or `data_loader` is given.
        reward_funcs (`list[str]`, *optional*):
            Reward functions by a kit's name for them (e.g. `sql_format_reward`) or dotted import path; overrides
            the task's.
        info_blocks (`list[str]`, *optional*):
            One info-block builder per reward: a kit's name for it, a dotted path, or `none`.
        data_loader (`str`, *optional*):
            `spider`, `bird`, `hir` or `rlla`: read `data_path` with that kit's reader.
        data_path (`str`, *optional*):
            Folder, file or hub id for `data_loader`.
        data_split_file (`str`, *optional*):
            For `spider` / `bird`: the examples file inside `data_path` (e.g. `train_spider.json`).
        database_dir (`str`, *optional*, defaults to `"database"`):
            For `spider` / `bird`: the databases folder inside `data_path`.
        num_prompts (`int`, *optional*, defaults to `256`):
            Prompts drawn from a kit's built-in data generator (kits with a fixed set use all of it).
        threads (`int`, *optional*):
            torch CPU threads; default: the free cores (usable cores minus the 1-minute load average, at least 1).
        failure_masking (`bool`, *optional*, defaults to `False`):
            Use the task kit's failure boundaries: after the point where a failing response's unrecovered error ends,
            that reward's negative credit is dropped (kits whose verifier knows the point: `sql`, `tools`).
        process_rewards (`list[str]`, *optional*):
            Process rewards (step-level scores) by dotted import path: each a function, or a class, instantiated
            without arguments.
        trainer (`str`, *optional*, defaults to `"mrtpo"`):
            `mrtpo`: `MRTPOTrainer`. `research`: `trl_mrtpo.research.ResearchTrainer`, for the sibling methods,
            ablations and calibrated-credit options (`ResearchConfig`'s fields). `opsd`: the comparison arm, TRL's
            experimental `SDFTTrainer` with the info blocks as the live teacher's privileged context
            (`trl_mrtpo.baselines.opsd`); the rewards are logged, not trained on, and the MRTPO fields are ignored.
        chat_template_path (`str`, *optional*):
            Sets the tokenizer's chat template (as TRL's `SFTConfig.chat_template_path`): a Jinja file, the name of
            a template TRL ships (`qwen3`, `qwen2_5`, `llama3_1`, ...: `trl/chat_templates/<name>.jinja`), or a
            tokenizer folder or hub id whose template is taken. Tool rollouts need a template that renders tool
            calls and results.
    """

    task: str | None = field(default=None, metadata={"help": f"Task kit: {', '.join(KIT_NAMES)}."})
    reward_funcs: list[str] | None = field(
        default=None, metadata={"help": "Reward functions: a kit's names for them or dotted import paths."}
    )
    info_blocks: list[str] | None = field(
        default=None, metadata={"help": "One info-block builder per reward: a kit's name, dotted path or 'none'."}
    )
    data_loader: str | None = field(
        default=None, metadata={"help": "Kit reader for data_path: spider, bird, hir or rlla."}
    )
    data_path: str | None = field(default=None, metadata={"help": "Folder, file or hub id read by data_loader."})
    data_split_file: str | None = field(
        default=None, metadata={"help": "spider/bird: examples file inside data_path, e.g. train_spider.json."}
    )
    database_dir: str = field(default="database", metadata={"help": "spider/bird: databases folder in data_path."})
    num_prompts: int = field(default=256, metadata={"help": "Prompts drawn from a kit's built-in data generator."})
    threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads; default: the free cores (cores minus the load average)."}
    )
    failure_masking: bool = field(
        default=False, metadata={"help": "Drop a failing reward's penalty after its error (the kit's boundaries)."}
    )
    process_rewards: list[str] | None = field(
        default=None, metadata={"help": "Process rewards (step scores) by dotted import path."}
    )
    trainer: str = field(
        default="mrtpo",
        metadata={
            "help": "mrtpo; research (sibling methods, ablations, options); or opsd: self-distillation with the info "
            "blocks as privileged context."
        },
    )

    chat_template_path: str | None = field(
        default=None,
        metadata={"help": "Chat template: a Jinja file, a template TRL ships by name (qwen3, ...), or a tokenizer."},
    )

    def __post_init__(self):
        own = [name for name in self.__dataclass_fields__ if name not in ScriptArguments.__dataclass_fields__]
        check_field_types(self, own)
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}.")
        if self.task is not None and self.task not in KIT_NAMES:
            raise ValueError(f"task={self.task!r} is unknown; choose one of {', '.join(KIT_NAMES)}.")


def make_parser():
    from trl import DatasetMixtureConfig, ModelConfig, TrlParser

    from ..research import ResearchConfig

    # ResearchConfig holds every MRTPOConfig field and the research room's; `trainer` says which trainer reads them.
    return TrlParser((MRTPOScriptArguments, ResearchConfig, ModelConfig, DatasetMixtureConfig), prog="trl-mrtpo train")


def parse_recipe(argv: Sequence[str]) -> tuple:
    """``(script_args, training_args, model_args, dataset_args)`` from a recipe and flags, as ``train`` and
    ``inspect --config`` read them."""
    return make_parser().parse_args_and_config(list(argv))


def load_datasets(script_args: MRTPOScriptArguments, training_args, dataset_args=None) -> tuple:
    """``(train_dataset, eval_dataset)`` a script configuration names: a kit reader, a TRL dataset (``dataset_name``
    or a ``datasets`` mixture, split by ``dataset_train_split`` / ``dataset_test_split``), or the task's built-in
    data. The eval split is loaded only when ``eval_strategy`` is not ``"no"``."""
    from datasets import DatasetDict, load_dataset

    wants_eval = str(getattr(training_args.eval_strategy, "value", training_args.eval_strategy)) != "no"
    loader = script_args.data_loader
    if loader is not None:
        loaders = data_loaders()
        if loader not in loaders:
            raise ValueError(f"unknown data_loader {loader!r}; choose one of {', '.join(sorted(loaders))}")
        train = loaders[loader](script_args.data_path, script_args.data_split_file, script_args.database_dir)
        return train, None
    if dataset_args is not None and dataset_args.datasets:
        from trl import get_dataset

        dataset = get_dataset(dataset_args)
    elif script_args.dataset_name:
        dataset = load_dataset(
            script_args.dataset_name, name=script_args.dataset_config, streaming=script_args.dataset_streaming
        )
    elif script_args.task:
        kit = get_kit(script_args.task)
        train = kit.dataset(script_args.num_prompts, training_args.seed, None)
        if not wants_eval:
            return train, None
        split = train.train_test_split(test_size=0.1, seed=training_args.seed)
        return split["train"], split["test"]
    else:
        raise ValueError("no training data: set task, dataset_name, datasets or data_loader")
    if not isinstance(dataset, (dict, DatasetDict)):
        return dataset, None
    if script_args.dataset_train_split not in dataset:
        raise ValueError(
            f"the dataset has no split {script_args.dataset_train_split!r}; its splits are {', '.join(dataset)}"
        )
    eval_dataset = None
    if wants_eval:
        if script_args.dataset_test_split not in dataset:
            raise ValueError(
                f"eval_strategy is {training_args.eval_strategy!r} but the dataset has no split "
                f"{script_args.dataset_test_split!r} (dataset_test_split); its splits are {', '.join(dataset)}"
            )
        eval_dataset = dataset[script_args.dataset_test_split]
    return dataset[script_args.dataset_train_split], eval_dataset


def recipe_rewards(script_args: MRTPOScriptArguments) -> tuple:
    """``(kit or None, reward functions, info-block builders)`` a recipe names: its task kit's, or its
    ``reward_funcs`` and ``info_blocks`` (kit names or dotted paths)."""
    kit = get_kit(script_args.task) if script_args.task else None
    rewards = list(kit.rewards) if kit else []
    blocks = list(kit.info_blocks) if kit else []
    if script_args.reward_funcs:
        rewards = [resolve(name, "reward") for name in script_args.reward_funcs]
        blocks = [None] * len(rewards)
    if script_args.info_blocks:
        blocks = [resolve(name, "info_block") for name in script_args.info_blocks]
    if not rewards:
        raise ValueError("no reward functions: set task or reward_funcs")
    return kit, rewards, blocks


def recipe_trainer_class(script_args: MRTPOScriptArguments, training_args) -> type | None:
    """The trainer class a recipe's ``trainer`` names (None for the OPSD arm), refusing the research room's settings
    under ``trainer: mrtpo``."""
    from ..research import ResearchTrainer
    from ..trainer import MRTPOTrainer

    if script_args.trainer not in ("mrtpo", "research", "opsd"):
        raise ValueError(f"trainer={script_args.trainer!r} is unknown; use 'mrtpo', 'research' or 'opsd'.")
    research = getattr(training_args, "research_settings", list)()
    if script_args.trainer == "mrtpo" and research:
        raise ValueError(
            f"{', '.join(research)} belong to the research room: add `trainer: research` to the recipe (or pass "
            "--trainer research)."
        )
    return {"mrtpo": MRTPOTrainer, "research": ResearchTrainer, "opsd": None}[script_args.trainer]


def recipe_process_rewards(script_args: MRTPOScriptArguments) -> list:
    """The recipe's ``process_rewards`` (dotted paths; a class is instantiated)."""
    process_rewards = [resolve(name, "process reward") for name in script_args.process_rewards or ()]
    return [p() if isinstance(p, type) else p for p in process_rewards]


def recipe_model(model_args) -> str:
    """The recipe's ``model_name_or_path`` as a hub id or folder (``embedded``: the embedded SmolLM2's)."""
    from .embedded import local_model

    model = model_args.model_name_or_path
    if model is None:
        raise ValueError("model_name_or_path is required (a hub id, a local folder, 'embedded' or 'embedded-agent')")
    written_as_path = model.startswith(("/", "./", "../", "~"))
    if written_as_path and not os.path.isdir(os.path.expanduser(model)):
        raise FileNotFoundError(f"model_name_or_path {model!r} is a path, and no such folder exists")
    return local_model(model)


class RecipeInputs(NamedTuple):
    """What a recipe names, resolved and checked before the model loads (:func:`recipe_inputs`)."""

    trainer_class: type | None
    template: str | None
    kit: Any
    rewards: list
    blocks: list
    boundaries: list | None
    process_rewards: list
    model: str
    train_dataset: Any
    eval_dataset: Any


def recipe_inputs(script_args: MRTPOScriptArguments, training_args, model_args, dataset_args=None) -> RecipeInputs:
    """Everything a recipe names that is known before the model loads, resolved: its trainer and chat template
    (:func:`check_recipe`), its rewards and info blocks (one block or None per reward), its failure boundaries and
    process rewards, its model (a local folder must exist) and its data. A mistake raises ``TypeError``,
    ``ValueError``, ``ImportError`` or ``FileNotFoundError`` naming it, which ``train`` shows after its usage line."""
    from ..checks.inputs import check_builders
    from ..utils import function_name

    trainer_class, template = check_recipe(script_args, training_args)
    kit, rewards, blocks = recipe_rewards(script_args)
    if kit is None or kit.environment is None:  # an environment's reward is added by TRL, with its own block
        check_builders(blocks, [function_name(f) for f in rewards])
    boundaries = None
    if script_args.failure_masking:
        if kit is None or not kit.failure_boundaries or script_args.reward_funcs:
            raise ValueError(
                "failure_masking uses a task kit's failure boundaries (the sql and tools kits have them) with the "
                "kit's own rewards; for your own rewards pass failure_boundaries to MRTPOTrainer in Python."
            )
        boundaries = list(kit.failure_boundaries)
    process_rewards = recipe_process_rewards(script_args)
    model = recipe_model(model_args)
    model_init_kwargs = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
        "attn_implementation": model_args.attn_implementation,
        "dtype": model_args.dtype,
    }
    training_args.model_init_kwargs = {**model_init_kwargs, **(training_args.model_init_kwargs or {})}
    train_dataset, eval_dataset = load_datasets(script_args, training_args, dataset_args)
    return RecipeInputs(trainer_class, template, kit, rewards, blocks, boundaries, process_rewards, model,
                        train_dataset, eval_dataset)  # fmt: skip


def build_trainer(
    script_args: MRTPOScriptArguments,
    training_args,
    model_args,
    dataset_args=None,
    recipe: str | None = None,
    inputs: RecipeInputs | None = None,
):
    """The MRTPOTrainer a recipe describes (``model_name_or_path: embedded`` is the embedded SmolLM2), from its
    :func:`recipe_inputs` (resolved here unless given). Model loading follows TRL's script: revision, attention
    implementation, dtype, ``trust_remote_code`` and the quantization config (QLoRA) reach ``from_pretrained``;
    ``model_init_kwargs`` of the recipe win."""
    from trl import get_peft_config, get_quantization_config

    from ..observability.callbacks import CreditPlotCallback

    inputs = inputs or recipe_inputs(script_args, training_args, model_args, dataset_args)
    (trainer_class, template, kit, rewards, blocks, boundaries, process_rewards, model, train_dataset,
     eval_dataset) = inputs  # fmt: skip
    if script_args.trainer == "opsd":
        return _opsd_trainer(script_args, training_args, model_args, model, rewards, blocks, train_dataset)
    processing_class = None
    if script_args.chat_template_path:
        from transformers import AutoTokenizer

        processing_class = AutoTokenizer.from_pretrained(model, revision=model_args.model_revision)
        processing_class.chat_template = template
    trainer = trainer_class(
        model=model,
        reward_funcs=rewards,
        info_blocks=blocks,
        process_rewards=process_rewards or None,
        failure_boundaries=boundaries,
        recipe=recipe,
        data_source=data_source(script_args, dataset_args),
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
        callbacks=[CreditPlotCallback()],
        processing_class=processing_class,
        **({"environment_factory": kit.environment} if kit is not None and kit.environment else {}),
    )
    if script_args.ignore_bias_buffers:  # as TRL's scripts do: DDP skips boolean buffers (e.g. causal masks)
        import torch

        trainer.model._ddp_params_and_buffers_to_ignore = [
            name for name, buffer in trainer.model.named_buffers() if buffer.dtype == torch.bool
        ]
    return trainer


def _opsd_trainer(script_args, training_args, model_args, model, rewards, blocks, train_dataset):
    """The OPSD comparison arm on the same recipe: shared fields carried over
    (:func:`trl_mrtpo.baselines.opsd.opsd_config`)."""
    from trl import get_peft_config

    from ..baselines.opsd import opsd_config, opsd_trainer_class

    if script_args.process_rewards or script_args.failure_masking:
        raise ValueError("process_rewards and failure_masking are MRTPOTrainer's credit rules; OPSD has no credit.")
    if script_args.chat_template_path:  # the OPSD arm loads its own tokenizer: the template would be dropped
        raise ValueError("chat_template_path is not passed to the OPSD arm (trainer: opsd); leave it out there.")
    return opsd_trainer_class()(
        model,
        rewards,
        blocks,
        opsd_config(training_args),
        train_dataset,
        peft_config=get_peft_config(model_args),
        separator=training_args.info_block_separator,
    )


def data_source(script_args: MRTPOScriptArguments, dataset_args=None) -> str | None:
    """The training data in words for the model card, when it is not a Hub dataset named by ``dataset_name``."""
    if script_args.data_loader:
        return f"`{script_args.data_path}` (read by trl-mrtpo's `{script_args.data_loader}` reader)"
    if dataset_args is not None and dataset_args.datasets:
        return "a mixture of " + ", ".join(f"`{d.path}`" for d in dataset_args.datasets)
    if not script_args.dataset_name and script_args.task:
        return f"trl-mrtpo's built-in `{script_args.task}` task data"
    return None


def main(
    script_args,
    training_args,
    model_args,
    dataset_args=None,
    recipe: str | None = None,
    inputs: RecipeInputs | None = None,
):
    """Build (from ``inputs`` when ``train`` resolved them already), train, save, write the model card, (with
    ``push_to_hub``) push and end the process group; returns the trainer."""
    import torch

    from . import default_threads

    torch.set_num_threads(script_args.threads or default_threads())
    trainer = build_trainer(script_args, training_args, model_args, dataset_args, recipe, inputs)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model(training_args.output_dir)
    trainer.save_state()  # trainer_state.json: the run's logged metrics, beside the model (benchmarks/agent_ab.py)
    trainer.accelerator.print(f"Model saved to {training_args.output_dir}.")
    dataset_name = script_args.dataset_name
    if trainer.accelerator.is_main_process:
        trainer.create_model_card(dataset_name=dataset_name)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
        trainer.accelerator.print(f"Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")
    # a process group still alive at interpreter shutdown can abort a rank (gloo's worker threads): end it here
    trainer.accelerator.end_training()
    return trainer


def check_recipe(script_args: MRTPOScriptArguments, training_args) -> tuple[type | None, str | None]:
    """What a recipe can get wrong that is known before the model loads: its credit rule (a name, or a dotted path
    imported from the working directory too, as the trainer resolves it), its trainer against its settings (a
    research-only option without ``trainer: research``) and its chat template (a file that is missing, empty or
    does not parse). Returns ``(trainer class, chat template text or None)``."""
    from ..checks.inputs import check_credit_settings
    from ..rules import resolve_credit_rule

    check_credit_settings(training_args, resolve_credit_rule(training_args))
    trainer_class = recipe_trainer_class(script_args, training_args)
    template = chat_template(script_args.chat_template_path) if script_args.chat_template_path else None
    return trainer_class, template


def warn_fsdp_on_cpu(launch_args: Sequence[str]) -> bool:
    """Say so when an FSDP config is launched without CUDA: accelerate's CPU backend ignores the FSDP plugin and runs
    plain data parallelism (every rank holds the whole model). Returns whether it warned."""
    import torch
    import yaml

    if torch.cuda.is_available() or "--config_file" not in launch_args:
        return False
    path = launch_args[list(launch_args).index("--config_file") + 1]
    with open(path) as handle:
        config = yaml.safe_load(handle) or {}
    if config.get("distributed_type") != "FSDP":
        return False
    print(
        f"warning: {path} asks for FSDP, but there is no CUDA device: accelerate's CPU backend ignores the FSDP "
        "plugin and runs plain data parallelism (each process holds the whole model). docs/recipes-eval-sharing.md, "
        '"Scaling out", says how the tests simulate sharding on CPU.',
        file=sys.stderr,
    )
    return True


def launch_train(argv: Sequence[str]) -> None:
    """``trl-mrtpo train --accelerate_config NAME ...``: the train script under ``accelerate launch``, with NAME one
    of the configs TRL ships (``single_gpu``, ``multi_gpu``, ``zero1``-``zero3``, ``fsdp1``, ``fsdp2``) or a file,
    resolved by TRL's own helper as ``trl grpo --accelerate_config`` does."""
    from accelerate.commands.launch import launch_command, launch_command_parser
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    argv = list(argv)
    at = argv.index("--accelerate_config")
    launch_args = resolve_accelerate_config_argument(argv[at : at + 2])
    warn_fsdp_on_cpu(launch_args)
    script_args = argv[:at] + argv[at + 2 :]
    launch_command(launch_command_parser().parse_args([*launch_args, __file__, *script_args]))


def run(argv: Sequence[str]):
    """``trl-mrtpo train ARGV``: a value the recipe gets wrong (its YAML, a reward or block path, the blocks' count, a
    data file, a model folder, ...) is refused after the usage line with exit status 2, as argparse refuses a flag,
    before the model loads (:func:`recipe_inputs`)."""
    import yaml

    argv = list(argv)
    parser = make_parser()
    try:
        parsed = parse_recipe(argv)
        inputs = recipe_inputs(*parsed)
    except (TypeError, ValueError, ImportError, FileNotFoundError, yaml.YAMLError) as error:
        parser.error(f"the recipe is not valid YAML: {error}" if isinstance(error, yaml.YAMLError) else str(error))
    recipe = argv[argv.index("--config") + 1] if "--config" in argv else None
    return main(*parsed, recipe=recipe, inputs=inputs)


if __name__ == "__main__":  # what `trl-mrtpo train --accelerate_config ...` launches
    run(sys.argv[1:])
