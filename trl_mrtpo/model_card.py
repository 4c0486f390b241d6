"""The model card of an MRTPO run: TRL's card with the real base model, the data, and a section on the credit
settings, the rewards and their info blocks, and the recipe, inside the training procedure."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from importlib import resources
from importlib.metadata import version
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import is_wandb_available
from trl import GRPOConfig

from ._trl import get_comet_experiment_url, get_trackio_space_url
from .config import MRTPOConfig
from .constants import LOCAL_MODEL_FILE
from .hub_ids import local_copies, write_hub_ids
from .utils import function_name, local_copy

# Settings a reader needs whatever their value: MRTPO's own, then the training essentials.
ALWAYS_SHOWN = ("credit_beta", "credit_warmup_steps", "max_second_moment_ratio", "learning_rate", "num_generations",
                "per_device_train_batch_size", "max_completion_length", "temperature", "loss_type", "beta",
                "num_iterations")  # fmt: skip


def base_model_id(name_or_path: str | None) -> str | None:
    """The Hub id of a base model: the id itself, the id a local copy names (the embedded model's cached folder), and
    None for any other local folder (nobody who downloads the card could load it)."""
    if not name_or_path:
        return None
    if os.path.isdir(name_or_path):
        copy = local_copy(name_or_path)
        return copy[0] if copy else None
    return name_or_path


def code(text: str) -> str:
    """``text`` as one Markdown code span that holds in a table cell: line breaks shown as ``\\n``, fenced by a run of
    backticks longer than any inside it, ``|`` escaped (GitHub reads a table's ``\\|`` before the span)."""
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    spaced = f" {text} " if len(fence) > 1 else text
    return f"{fence}{spaced}{fence}".replace("|", "\\|")


def plain(text: str) -> str:
    """``text`` shown as written, never as Markdown (no link, no emphasis), on one line."""
    return re.sub(r"([\\`*_\[\]()<>|!#])", r"\\\1", " ".join(text.split()))


def hub_dataset(name: str | None) -> str | None:
    """``name`` when it is a Hub dataset id (linked in the card), else None."""
    try:
        validate_repo_id(name)
    except (HFValidationError, TypeError):
        return None
    return name


def settings_lines(args: MRTPOConfig) -> list[str]:
    """``name: value`` for the settings always shown, then every other MRTPO field that differs from its default."""
    lines = [f"{name}: {getattr(args, name)}" for name in ALWAYS_SHOWN]
    steps = f"max_steps: {args.max_steps}" if args.max_steps > 0 else f"num_train_epochs: {args.num_train_epochs}"
    lines.append(steps)
    grpo_fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    for field in dataclasses.fields(args):  # a research configuration's options too
        if field.name in grpo_fields or field.name in ("credit_assignment", *ALWAYS_SHOWN):
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        value = getattr(args, field.name)
        if value != default:
            lines.append(f"{field.name}: {value!r} (default {default!r})")
    return lines


def local_model_name(path: str | None) -> str | None:
    """The name ``trl_mrtpo.scripts.embedded.local_model`` loads the folder ``path`` by (an embedded model), or
    None."""
    marker = Path(path, LOCAL_MODEL_FILE) if path and os.path.isdir(path) else None
    return marker.read_text(encoding="utf-8").strip() if marker and marker.is_file() else None


def build_model_card(trainer, model_name: str | None = None, dataset_name: str | None = None, tags=None) -> ModelCard:
    """The card of ``trainer``'s run (an :class:`~trl_mrtpo.MRTPOTrainer`), as :meth:`create_model_card` saves it."""
    from peft import PeftModel

    from ._trl import get_config_model_id

    model = trainer.accelerator.unwrap_model(trainer.model)
    adapter = isinstance(model, PeftModel)
    base_path = model.peft_config["default"].base_model_name_or_path if adapter else get_config_model_id(model.config)
    base_model = base_model_id(base_path)
    copy = local_copy(base_path)
    model_id = trainer.hub_model_id or trainer.args.output_dir
    model_name = model_name or os.path.basename(os.path.normpath(trainer.hub_model_id or trainer.args.output_dir))
    tags = {tags} if isinstance(tags, str) else set(tags or [])
    tags.update(trainer._tag_names)
    if adapter:
        tags.add("lora")
    hub_data = hub_dataset(dataset_name)
    card_data = ModelCardData(
        base_model=base_model,
        datasets=hub_data,
        library_name="peft" if adapter else "transformers",
        model_name=model_name,
        tags=["generated_from_trainer", *sorted(tags)],
    )
    names, builders = trainer.reward_func_names, trainer.info_block_builders

    def block(k: int) -> str:
        if builders[k] is None:
            return "none (uniform credit)"
        twins = [names[i] for i, other in enumerate(builders) if i != k and other is builders[k]]
        shared = (
            f", shared with {', '.join(map(code, twins))}: one piece of information (one information group)"
            if twins
            else ""
        )
        return f"{code(function_name(builders[k]))}{shared}"

    rewards = [  # names as code spans that keep their table row
        (code(name), f"{weight:g}", block(k))
        for k, (name, weight) in enumerate(zip(names, trainer.reward_weights.tolist()))
    ]
    agent = []
    if getattr(trainer, "tools", None):  # a tool-calling run: its environments, tools and template
        from .trajectories import agent_card_lines

        agent = agent_card_lines(trainer)
    return ModelCard.from_template(
        card_data,
        template_path=str(resources.files("trl_mrtpo").joinpath("templates/mrtpo_model_card.md")),
        base_model=base_model,
        base_model_note=copy[1] if copy else None,
        model_name=model_name,
        model_id=model_id,
        adapter=adapter,
        local_model=local_model_name(base_path) if adapter else None,
        dataset_name=hub_data,
        dataset_text=plain(dataset_name) if dataset_name and not hub_data else None,
        data_source=trainer.data_source,
        mrtpo_version=version("trl-mrtpo"),
        trainer_name=trainer._name,
        paper_title=trainer._paper["title"],
        trainer_citation=trainer._paper["citation"],
        credit_assignment=trainer.args.credit_assignment,
        settings=[
            *settings_lines(trainer.args),
            *(line for t in trainer.credit_terms.values() for line in t.card_lines(code)),
        ],
        agent=agent,
        rewards=rewards,
        recipe=trainer.recipe and code(trainer.recipe),
        recipe_command=trainer.recipe and code(f"trl-mrtpo train --config {shlex.quote(trainer.recipe)}"),
        wandb_url=_wandb_url(),
        trackio_url=get_trackio_space_url(),
        comet_url=get_comet_experiment_url(),
        trl_version=version("trl"),
        transformers_version=version("transformers"),
        pytorch_version=version("torch"),
        datasets_version=version("datasets"),
        tokenizers_version=version("tokenizers"),
    )


def _wandb_url() -> str | None:
    """The active Weights & Biases run's URL, as TRL's own card reads it."""
    if not is_wandb_available():
        return None
    import wandb

    return wandb.run.url if wandb.run is not None else None


class ModelCards:
    """The trainer's model card: written beside the weights at every save (``save_model``, checkpoints; it replaces
    PEFT's blank template) and by ``create_model_card``, on the main process."""

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """Saves as transformers does, then this run's model card beside the weights (``save_model``, checkpoints: it
        replaces PEFT's blank template); an adapter of a local copy of a Hub model names the Hub id
        (:mod:`.hub_ids`)."""
        folder = output_dir or self.args.output_dir
        super()._save(output_dir, state_dict)
        write_hub_ids(local_copies(self.accelerator.unwrap_model(self.model)), folder)
        self._write_model_card(folder)

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """The model card (``README.md`` in ``output_dir``): TRL's, with the real base model, the data, and the
        MRTPO settings, rewards, info blocks and recipe in the training procedure (:mod:`trl_mrtpo.model_card`)."""
        self._write_model_card(self.args.output_dir, model_name=model_name, dataset_name=dataset_name, tags=tags)

    def _write_model_card(self, folder: str, **details) -> None:
        if not self.is_world_process_zero():
            return
        build_model_card(self, **details).save(os.path.join(folder, "README.md"))
