"""The one seam to TRL's and transformers' private names (TRL 1.16, transformers 5).

Every private name the package uses is listed here with what it is; the rest of the package reaches TRL's private
helpers only through this module, so a TRL upgrade that moves one fails here, in one place, and
``tests/test_trl_seam.py`` says which name is gone. Overridden methods cannot be imported: they are listed in
:data:`GRPO_TRAINER_NAMES` and checked on the installed ``GRPOTrainer``.
"""

from __future__ import annotations

import inspect

import torch

# Sampled-token log-probabilities from hidden states and the lm_head weight, vocabulary-tiled (TRL 1.16; private and
# renamed in TRL's development branch).
from trl.kernels import ChunkedLogProbFunction

# Gathers a ZeRO-3 / FSDP-sharded lm_head weight for the replay; the model id and tracker URLs of the model card
# (TRL 1.16, trl.trainer.utils: not TRL's documented API).
from trl.trainer.utils import (
    get_comet_experiment_url,
    get_config_model_id,
    get_trackio_space_url,
    maybe_gather_lm_head_ctx,
)

# What MRTPOTrainer overrides, calls or reads on GRPOTrainer (and transformers' Trainer), private or not public API.
GRPO_TRAINER_NAMES = {
    "_calculate_rewards": "overridden: keeps the per-reward rewards TRL does not expose (TRL 1.16)",
    "_generate_and_score_completions": "overridden: replaces the sequence advantages by token advantages (TRL 1.16)",
    "_tokenize_prompts": "called: the prompt token ids of the replay contexts, as generation tokenises them",
    "_save_checkpoint": "overridden (TRL's own extra-state hook, transformers Trainer): writes MRTPO's state",
    "_load_optimizer_and_scheduler": "overridden (where TRL reads its extra state back on resume): reads MRTPO's",
    "_get_output_dir": "called (transformers Trainer): the run folder that holds the checkpoint folders",
    "_save": "overridden (transformers Trainer): an adapter of a local model copy is saved without a Hub lookup",
}
# Instance attributes read or written (set in GRPOTrainer.__init__, TRL 1.16): the metrics and completions-table
# logs, the vision-language and tool-rollout flags the replay refuses, and the eval group size.
GRPO_TRAINER_ATTRIBUTES = ("_metrics", "_logs", "_is_vlm", "tools", "environment_factories", "num_generations_eval")
# What the OPSD arm (trl_mrtpo.opsd) overrides or reads on TRL's experimental SDFTTrainer (TRL 1.16).
SDFT_TRAINER_NAMES = {
    "sample_rollouts": "overridden: scores each rollout with the reward functions, for logging only",
}
SDFT_TRAINER_ATTRIBUTES = ("_metrics",)
SDFT_BATCH_KEYS = ("completion_ids", "raw_completion_lengths")  # read from sample_rollouts' batch

__all__ = [
    "get_comet_experiment_url",
    "get_config_model_id",
    "get_trackio_space_url",
    "maybe_gather_lm_head_ctx",
    "missing_names",
    "sampled_token_logprobs",
    "tokenize_prompts",
]


def tokenize_prompts(trainer, prompts: list) -> list[list[int]]:
    """Prompt token ids exactly as GRPOTrainer tokenises prompts for generation (chat template, special tokens)."""
    return trainer._tokenize_prompts(prompts)[0]


def sharding_engine(trainer) -> str | None:
    """The engine that shards the policy's parameters across processes, by the names transformers' Trainer sets
    (``is_deepspeed_enabled``, ``is_fsdp_enabled``), or None when every process holds them whole (one process, DDP,
    ZeRO-1/2)."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP"
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = trainer.accelerator.state.deepspeed_plugin
        if plugin is not None and plugin.zero_stage == 3:
            return "DeepSpeed ZeRO-3"
    return None


def sampled_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
    vocab_chunk_size: int,
) -> torch.Tensor:
    """``[N]`` log-probabilities of ``token_ids`` from TRL's ``ChunkedLogProbFunction`` (nine positional arguments in
    TRL 1.16: hidden, weight, bias, ids, temperature, chunk size, soft-capping, logit scale, optional outputs)."""
    return ChunkedLogProbFunction.apply(
        hidden, lm_head_weight, lm_head_bias, token_ids, temperature, vocab_chunk_size, None, 1.0, ()
    )[0]


def missing_names() -> list[str]:
    """What the installed TRL lacks of what this module relies on (empty when everything is there)."""
    from trl import GRPOTrainer

    missing = [f"GRPOTrainer.{name}" for name in GRPO_TRAINER_NAMES if not hasattr(GRPOTrainer, name)]
    init = inspect.getsource(GRPOTrainer.__init__)
    missing += [f"GRPOTrainer().{name}" for name in GRPO_TRAINER_ATTRIBUTES if f"self.{name} =" not in init]
    from trl.experimental.sdft import SDFTTrainer

    missing += [f"SDFTTrainer.{name}" for name in SDFT_TRAINER_NAMES if not hasattr(SDFTTrainer, name)]
    init, rollouts = inspect.getsource(SDFTTrainer.__init__), inspect.getsource(SDFTTrainer.sample_rollouts)
    missing += [f"SDFTTrainer().{name}" for name in SDFT_TRAINER_ATTRIBUTES if f"self.{name} =" not in init]
    missing += [f"SDFTTrainer.sample_rollouts()['{key}']" for key in SDFT_BATCH_KEYS if f'"{key}"' not in rollouts]
    forward = inspect.signature(ChunkedLogProbFunction.forward)
    if len(forward.parameters) != 10:  # ctx and the nine arguments above
        missing.append(f"ChunkedLogProbFunction.forward with 9 arguments (found {len(forward.parameters) - 1})")
    return missing
