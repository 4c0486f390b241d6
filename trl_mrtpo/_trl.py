"""The one seam to TRL's and transformers' private names (TRL 1.16, transformers 5).

Every private name the package uses is listed here with what it is; the rest of the package reaches TRL's private
helpers only through this module, so a TRL upgrade that moves one fails here, in one place, and
``tests/test_trl_seam.py`` says which name is gone. Overridden methods cannot be imported: they are listed in
:data:`GRPO_TRAINER_NAMES` and checked on the installed ``GRPOTrainer``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin
from transformers.utils import logging

# TRL's own detection of ZeRO-3 / FSDP and its context for generating with a ZeRO-3 model gathered whole (TRL 1.16).
from trl.distributed import DistributedBackend

# Sampled-token log-probabilities from hidden states and the lm_head weight, vocabulary-tiled: public in trl.kernels
# since TRL 1.16 (before it, the private _ChunkedLogProbFunction of trl.trainer.utils, with 7 arguments).
from trl.kernels import ChunkedLogProbFunction
from trl.models.utils import unwrap_model_for_generation

# Gathers a ZeRO-3 / FSDP-sharded lm_head weight for the replay; the model id and tracker URLs of the model card
# (TRL 1.16, trl.trainer.utils: not TRL's documented API).
from trl.trainer.utils import (
    get_comet_experiment_url,
    get_config_model_id,
    get_trackio_space_url,
    maybe_gather_lm_head_ctx,
)

logger = logging.get_logger(__name__)

# What MRTPOTrainer overrides, calls or reads on GRPOTrainer (and transformers' Trainer), private or not public API.
GRPO_TRAINER_NAMES = {
    "_calculate_rewards": "overridden: keeps the per-reward rewards TRL does not expose (TRL 1.16)",
    "_generate_and_score_completions": "overridden: replaces the sequence advantages by token advantages (TRL 1.16)",
    "_tokenize_prompts": "called: the prompt token ids of the replay contexts, as generation tokenises them",
    "_save_checkpoint": "overridden (transformers Trainer): MRTPO's state is serialised before the checkpoint",
    "_load_optimizer_and_scheduler": "overridden (where TRL reads its extra state back on resume): reads MRTPO's",
    "_save_rng_state": "overridden (transformers Trainer, inside _save_checkpoint, per process, before a Hub upload): "
    "MRTPO's state is written beside the RNG state",
    "_save": "overridden (transformers Trainer): an adapter of a local model copy is saved without a Hub lookup",
    "_generate_single_turn": "overridden by inspect's replay of recorded tool trajectories: serves their turns",
    "_tool_call_loop": "overridden by inspect's replay of recorded tool trajectories: reads the tool results",
}
# Python's error when GRPOTrainer._generate_and_score_completions appends what an environment's reset() returned to
# the prompt's text and it is not a string (TRL 1.16 appends with +): the returned type is its group 1.
RESET_APPEND_ERROR = re.compile(r'can only concatenate str \(not "(\w+)"\) to str')
# What GRPOTrainer._calculate_rewards passes a reward function besides the dataset's columns (TRL 1.16): the columns
# it withholds, and the arguments it supplies itself (``environments`` with an environment_factory).
REWARD_WITHHELD_COLUMNS = ("prompt", "completion", "completion_ids")
REWARD_SUPPLIED_ARGUMENTS = (
    "prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "environments",
)  # fmt: skip
# Instance attributes read or written (set in GRPOTrainer.__init__, TRL 1.16): the metrics and completions-table
# logs, the vision-language and tool-rollout flags the replay refuses, the eval group size, and the batch's
# environments (whose reset() values the prompts carry).
GRPO_TRAINER_ATTRIBUTES = (
    "_metrics", "_logs", "_is_vlm", "tools", "environment_factories", "num_generations_eval", "environments",
)  # fmt: skip
# ... and with ``environment_factory``: each example's environment name (set for the batch being generated), checked
# after a tool-rollout step (tests/test_agent_kit.py).
GRPO_ENVIRONMENT_ATTRIBUTES = ("_batch_environments",)
# What the OPSD arm (trl_mrtpo.baselines.opsd) overrides or reads on TRL's experimental SDFTTrainer (TRL 1.16);
# that the hook is called, the attribute set and the batch keys present is checked by a run (tests/test_opsd.py).
SDFT_TRAINER_NAMES = {
    "sample_rollouts": "overridden: scores each rollout with the reward functions, for logging only",
}
SDFT_TRAINER_ATTRIBUTES = ("_metrics",)
SDFT_BATCH_KEYS = ("completion_ids", "raw_completion_lengths")  # read from sample_rollouts' batch

# What the package reads of transformers' (5) internals, private or not documented as API (each checked on the
# installed transformers by tests/test_trl_seam.py): whether a packed replay row's mask and positions reach a model's
# attention, what its cache holds (trl_mrtpo.replay.rule_path), tensor parallelism (refused) and a de-quantised copy's
# flag.
TRANSFORMERS_NAMES = {
    "PretrainedConfig._attn_implementation": "the attention a model runs (sdpa, eager: a dense mask)",
    "FalconConfig.alibi": "Falcon's ALiBi flag (its decoder takes position_ids, its bias ignores them)",
    "MptConfig.attn_config.alibi": "MPT's ALiBi flag (remote-code configs hold attn_config as a dict)",
    "xLSTMConfig.output_logit_soft_cap": "xLSTM's final logit soft-cap (Gemma's is final_logit_softcapping)",
    "PreTrainedModel._tp_size": "the tensor-parallel degree of a model loaded with tp_plan (refused)",
    "PretrainedConfig._is_quantized": "written False on the embedded model's de-quantised copy",
    "cache_utils.DynamicLayer": "an attention layer's cache, appended by concatenation: shared without a copy",
    "cache_utils.DynamicSlidingWindowLayer": "a sliding-window attention layer's cache, shared as DynamicLayer",
    "cache_utils.LinearAttentionCacheLayerMixin": "a state-space or linear-attention layer's state: never shared",
}

__all__ = [
    "DynamicLayer",
    "DynamicSlidingWindowLayer",
    "LinearAttentionCacheLayerMixin",
    "compile_chat_template",
    "get_comet_experiment_url",
    "get_config_model_id",
    "get_trackio_space_url",
    "gathered_for_probe",
    "log_completion_column",
    "log_metric",
    "maybe_gather_lm_head_ctx",
    "missing_names",
    "replace_logged_advantages",
    "sampled_token_logprobs",
    "sharding_engine",
    "tokenize_contexts",
    "tokenize_prompts",
    "whole_policy",
]


def compile_chat_template(text: str):
    """Compiles a chat template as ``apply_chat_template`` does (transformers 5's private
    ``chat_template_utils._compile_jinja_template``: its sandboxed environment and ``{% generation %}`` tag), so a
    template that does not parse is refused when it is set, not at the first render; raises
    ``jinja2.TemplateSyntaxError``."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(text)


def tokenize_prompts(trainer, prompts: list, owners: list[int] | None = None) -> list[list[int]]:
    """Prompt token ids exactly as GRPOTrainer tokenises prompts for generation (chat template, special tokens).

    ``owners``: for each prompt, the local example it belongs to (None: one prompt per example, in order). With
    ``environment_factory`` TRL renders each prompt with its own environment's tool schema, read from
    ``_batch_environments`` (one name per local example, set for the batch being generated, TRL 1.16); the replay's
    contexts take their example's.
    """
    environments = getattr(trainer, "_batch_environments", None)
    if trainer.environment_factories is None or environments is None or owners is None:
        return trainer._tokenize_prompts(prompts)[0]
    trainer._batch_environments = [environments[i] for i in owners]
    try:
        return trainer._tokenize_prompts(prompts)[0]
    finally:
        trainer._batch_environments = environments


def tokenize_contexts(trainer, contexts: list[list]) -> list[list[list[int]]]:
    """Each sample's replay contexts (a list per local example) tokenised in one call of :func:`tokenize_prompts`."""
    flat = [context for sample in contexts for context in sample]
    owners = [i for i, sample in enumerate(contexts) for _ in sample]
    flat_ids = iter(tokenize_prompts(trainer, flat, owners) if flat else [])
    return [[next(flat_ids) for _ in sample] for sample in contexts]


def log_metric(trainer, mode: str, name: str, value: float) -> None:
    """Adds ``value`` to TRL's metric ``name`` (``"train"`` or ``"eval"``), averaged and logged at TRL's next log
    (``GRPOTrainer._metrics``, as TRL logs its own)."""
    trainer._metrics[mode][name].append(value)


def log_completion_column(trainer, name: str, values: list) -> None:
    """One more column of TRL's completions table (``GRPOTrainer._logs["extra"]``), one value per completion."""
    trainer._logs["extra"][name].extend(values)


def replace_logged_advantages(trainer, values: list[float]) -> None:
    """Overwrites the last ``len(values)`` advantages TRL logged with its completions (``GRPOTrainer._logs``, a deque
    as long as one generation batch) by what the loss will see."""
    logged = trainer._logs["advantages"]
    for i in range(1, min(len(logged), len(values)) + 1):
        logged[-i] = values[-i]


def sharding_engine(trainer) -> str | None:
    """The engine that shards the policy's parameters across processes, by TRL's own detection
    (``trl.distributed.DistributedBackend``), or None when every process holds them whole (one process, DDP,
    ZeRO-1/2)."""
    backend = DistributedBackend(trainer.accelerator)
    if backend.is_zero3:
        return "DeepSpeed ZeRO-3"
    if backend.is_fsdp:
        return f"FSDP{backend.fsdp_version}"
    return None


FSDP_HOOKS = "torch.distributed.fsdp."  # where FSDP2's forward hooks are defined (one unit's or a group's)


@contextmanager
def whole_policy(trainer) -> Iterator[nn.Module]:
    """The policy, unwrapped, with every parameter whole on this process while in the context, so that the replay's
    forwards are local: their number may differ from process to process.

    Under ZeRO-3 the parameters are gathered and DeepSpeed's hooks removed, exactly as TRL does to generate
    (``unwrap_model_for_generation``); under FSDP2 every FSDP unit is unsharded and its FSDP forward hooks set aside
    until the context closes, then resharded. Entering and leaving are collectives there: every
    process must enter at the same points, whatever it has to replay. Elsewhere this is the unwrapped model.
    """
    backend = DistributedBackend(trainer.accelerator)
    if backend.is_zero3:
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            yield model
        return
    model = trainer.accelerator.unwrap_model(trainer.model)
    if backend.fsdp_version != 2:
        yield model
        return
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in trainer.model_wrapped.modules() if isinstance(m, FSDPModule)]
    for unit in units:  # the same units in the same order on every process
        unit.unshard()
    # FSDP's own forward hooks stay out of the replay, as TRL removes DeepSpeed's to generate: they would gather
    # again after each forward and record the replay's forwards in the order the backward prefetches by, which then
    # differs between processes that replayed different amounts.
    saved = [(unit, unit._forward_pre_hooks.copy(), unit._forward_hooks.copy()) for unit in units]
    for unit in units:
        for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
            for key in [k for k, hook in hooks.items() if getattr(hook, "__module__", "").startswith(FSDP_HOOKS)]:
                del hooks[key]
    try:
        yield model
    finally:
        for unit, pre_hooks, hooks in saved:
            unit._forward_pre_hooks.clear()
            unit._forward_pre_hooks.update(pre_hooks)
            unit._forward_hooks.clear()
            unit._forward_hooks.update(hooks)
            unit.reshard()


def without_mixed_precision(model) -> None:
    """A model object another trainer prepared in mixed precision carries that run's autocast on its forward
    (accelerate's ``_original_forward``): taken off in place before TRL patches the forward with its fused head, so
    that this run trains at its own precision and the patch is not stripped from under TRL later."""
    if isinstance(model, nn.Module) and "_original_forward" in model.__dict__:
        from accelerate.utils import extract_model_from_parallel

        extract_model_from_parallel(model, keep_fp32_wrapper=False)


def gathered_for_probe(model: nn.Module):
    """All parameters gathered while in the context when ZeRO-3 partitioned them at load (``zero.Init``), for a
    start-up forward before DeepSpeed wraps the model; a null context otherwise."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if not is_deepspeed_zero3_enabled():
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def sampled_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
    vocab_chunk_size: int,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[N]`` log-probabilities of ``token_ids`` from TRL's ``ChunkedLogProbFunction`` (nine positional arguments in
    TRL 1.16: hidden, weight, bias, ids, temperature, chunk size, soft-capping, logit scale, optional outputs)."""
    return ChunkedLogProbFunction.apply(
        hidden, lm_head_weight, lm_head_bias, token_ids, temperature, vocab_chunk_size, softcap, 1.0, ()
    )[0]


def missing_names() -> list[str]:
    """What the installed TRL lacks of what this module relies on (empty when everything is there)."""
    from trl import GRPOTrainer

    missing = [f"GRPOTrainer.{name}" for name in GRPO_TRAINER_NAMES if not hasattr(GRPOTrainer, name)]
    from trl.experimental.sdft import SDFTTrainer

    missing += [f"SDFTTrainer.{name}" for name in SDFT_TRAINER_NAMES if not hasattr(SDFTTrainer, name)]
    forward = inspect.signature(ChunkedLogProbFunction.forward)
    if len(forward.parameters) != 10:  # ctx and the nine arguments above
        missing.append(f"ChunkedLogProbFunction.forward with 9 arguments (found {len(forward.parameters) - 1})")
    return missing
