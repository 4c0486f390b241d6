"""OPSD, on-policy self-distillation with privileged information, as a comparison arm: the rewards' info blocks
become the privileged context of TRL's own ``trl.experimental.sdft.SDFTTrainer``, whose teacher is the current
policy (``teacher_model_kind="live"``) shown the prompt followed by that context. Nothing here re-implements the
distillation; this module builds the context column, the configuration, and logs the rewards of the rollouts so
that the arm is compared with the credit modes on the same numbers.

Only blocks that do not need a response can be privileged context (the teacher's prompt is built before sampling):
each builder is called with an empty completion, and a block it then returns (a format rule, a reference answer,
a constraint sentence) joins the context; a block about the response itself (the SQL kit's error message) does
not. For in-prompt kits the constraints are already in the student's prompt: the teacher sees them restated after
it, the only privileged information those kits have.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._trl import log_metric
from ..checks.batch import checked_reward
from ..checks.inputs import check_builders
from ..info_blocks import build_block, per_reward
from ..steps.process_rewards import reward_columns
from ..utils import function_name

# MRTPOConfig fields that mean the same in SDFTConfig: what a recipe or benchmark sets for every arm.
SHARED_FIELDS = (
    "output_dir",
    "max_steps",
    "num_train_epochs",
    "per_device_train_batch_size",
    "gradient_accumulation_steps",
    "num_generations",
    "max_completion_length",
    "learning_rate",
    "lr_scheduler_type",
    "warmup_ratio",
    "weight_decay",
    "max_grad_norm",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logging_steps",
    "save_strategy",
    "save_steps",
    "report_to",
    "use_cpu",
    "bf16",
    "disable_tqdm",
    "activation_checkpointing",
    "push_to_hub",
    "hub_model_id",
    "run_name",
    "model_init_kwargs",
)


def opsd_config(args: Any, **overrides: Any):
    """An ``SDFTConfig`` with ``args``' shared fields (:data:`SHARED_FIELDS`) and a live teacher (the current
    policy); ``overrides`` set any SDFTConfig field."""
    from trl.experimental.sdft import SDFTConfig

    known = {f.name for f in dataclasses.fields(SDFTConfig)}
    values = {name: getattr(args, name) for name in SHARED_FIELDS if name in known and hasattr(args, name)}
    return SDFTConfig(**{**values, "teacher_model_kind": "live", **overrides})


def privileged_context(
    prompt: Any,
    row: dict,
    builders: Sequence[Callable | None],
    reward_names: Sequence[str],
    separator: str,
    sample: int = 0,
) -> str:
    """The blocks of one sample that need no response, joined by ``separator`` (empty when there is none);
    ``sample`` is the row's index, for the errors of a builder."""
    texts = []
    for builder, name in zip(builders, reward_names):
        if builder is None:
            continue
        block = build_block(builder, name, sample, prompt, "", row, math.nan)
        if block is not None:
            texts.append(block.text)
    return separator.join(texts)


def with_privileged_context(dataset, builders: Sequence[Callable | None], reward_names: Sequence[str], separator: str):
    """``dataset`` with a ``privileged_context`` column; an error when no row has any (the teacher would be the
    student itself)."""

    def add(row: dict, index: int) -> dict:
        context = privileged_context(row["prompt"], row, builders, reward_names, separator, index)
        return {"privileged_context": context}

    dataset = dataset.map(add, with_indices=True)
    if not any(dataset["privileged_context"]):
        raise ValueError(
            "OPSD has no privileged information here: every info block is None or needs the response. Its teacher "
            "would be the student itself."
        )
    return dataset


def opsd_trainer_class():
    """``OPSDTrainer``, defined on first use: TRL's experimental SDFT trainer is imported only when OPSD runs."""
    from trl.experimental.sdft import SDFTTrainer

    class OPSDTrainer(SDFTTrainer):
        """TRL's ``SDFTTrainer`` with the info blocks as privileged context and the reward functions scoring (not
        training on) every rollout, logged as ``rewards/<name>/mean`` like the credit modes.

        Args:
            model: as for ``SDFTTrainer``.
            reward_funcs: TRL reward functions; their means are logged, never optimised.
            info_blocks: one builder (or None) per reward (:mod:`trl_mrtpo.info_blocks`).
            args: an ``SDFTConfig`` (:func:`opsd_config` makes one from an ``MRTPOConfig``).
            separator: between the blocks of the privileged context.
        """

        _tag_names = ["trl", "sdft", "opsd", "mrtpo"]
        _name = "OPSD"

        def __init__(
            self,
            model,
            reward_funcs: Sequence[Callable],
            info_blocks: Sequence[Callable | None],
            args,
            train_dataset,
            processing_class=None,
            peft_config=None,
            separator: str = "\n\n",
            **kwargs,
        ):
            self.reward_func_names = [function_name(f) for f in reward_funcs]
            # checked where they return, as in MRTPOTrainer: a bad value names the function and the sample
            self.scoring_funcs = [checked_reward(f, name) for f, name in zip(reward_funcs, self.reward_func_names)]
            check_builders(info_blocks, self.reward_func_names)
            builders = per_reward(info_blocks, len(self.reward_func_names))
            train_dataset = with_privileged_context(train_dataset, builders, self.reward_func_names, separator)
            super().__init__(
                model,
                args=args,
                train_dataset=train_dataset,
                processing_class=processing_class,
                peft_config=peft_config,
                **kwargs,
            )

        def sample_rollouts(self, inputs: list[dict[str, Any]]):
            batch = super().sample_rollouts(inputs)
            mode = "train" if self.model.training else "eval"
            table = self.score_rollouts(inputs, batch)
            for k, name in enumerate(self.reward_func_names):
                scored = table[:, k][~torch.isnan(table[:, k])]
                if scored.numel():
                    log_metric(self, mode, f"rewards/{name}/mean", scored.mean().item())
            # TRL's "reward": the rewards summed per response (a None counts as 0), averaged over the batch
            log_metric(self, mode, "reward", table.nansum(1).mean().item())
            return batch

        def score_rollouts(self, inputs: list[dict[str, Any]], batch) -> torch.Tensor:
            """``[N, K]`` every reward of every rollout of ``batch`` (NaN where a reward returned None)."""
            lengths = batch["raw_completion_lengths"].tolist()
            texts = self.processing_class.batch_decode(
                [ids[:n] for ids, n in zip(batch["completion_ids"].tolist(), lengths)], skip_special_tokens=True
            )
            conversational = isinstance(inputs[0]["prompt"], list)
            completions = [[{"role": "assistant", "content": t}] for t in texts] if conversational else texts
            columns = reward_columns(inputs)
            prompts = [row["prompt"] for row in inputs]
            table = [
                [
                    math.nan if v is None else v
                    for v in func(prompts=prompts, completions=completions, trainer_state=self.state, **columns)
                ]
                for func in self.scoring_funcs
            ]
            return torch.tensor(table, dtype=torch.float32).T

    return OPSDTrainer
