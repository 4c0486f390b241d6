"""Configuration of :class:`trl_mrtpo.MRTPOTrainer`."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, fields

from transformers import TrainingArguments
from trl import GRPOConfig

from .checks.config import check_config_ranges, check_field_types, check_finite_fields
from .constants import REPLAY_BATCH_SIZE

# whether the installed transformers reads activation_checkpointing (5.17 and older: only gradient_checkpointing)
RENAMED_CHECKPOINTING = "activation_checkpointing" in {f.name for f in fields(TrainingArguments)}


@dataclass
class MRTPOConfig(GRPOConfig):
    r"""
    Configuration class for [`MRTPOTrainer`].

    Inherits every parameter of [`trl.GRPOConfig`]. Note that `beta` there is still the KL coefficient; the credit
    redistribution strength of MRTPO is `credit_beta`.

    Parameters:
        > Parameters that control the credit assignment

        credit_assignment (`str`, *optional*, defaults to `"mrtpo"`):
            Where each reward's credit lands. `"mrtpo"`: each reward's advantage is redistributed over the tokens
            its info block makes the policy change its mind on. `"gdpo"`: per-reward group normalisation, uniform
            over tokens (the same pipeline with `credit_beta=0`). `"grpo"`: plain `GRPOTrainer` behaviour
            (`multi_objective_aggregation` as set). Any other credit rule registered for this configuration class
            ([`trl_mrtpo.rules.register_credit_rule`]; the sibling methods and ablations are registered for
            [`trl_mrtpo.research.ResearchConfig`]), or a `CreditRule` subclass by dotted import path
            (`my_package.rules.MyRule`). The trainer resolves the name at construction, before the model loads.
        credit_beta (`float`, *optional*, defaults to `0.5`):
            Redistribution strength in [0, 1]: every token keeps at least `1 - credit_beta` of the uniform credit.
        credit_warmup_steps (`float`, *optional*, defaults to `10`):
            Optimizer steps over which `credit_beta` ramps up smoothly from 0 (`3u^2 - 2u^3`); a value below 1 is a
            fraction of `max_steps`, as transformers reads `warmup_steps`. 0 disables warm-up. A run shorter than
            twice its warm-up is warned about.
        max_second_moment_ratio (`float`, *optional*, defaults to `2.0`):
            Cap rho: the batch's token-advantage second moment stays at most rho times that of uniform spreading.
        reward_strength_floor (`float` or `None`, *optional*, defaults to `0.25`):
            Per-reward strength: reward k's beta is `credit_beta * g_k`, `g_k` rising linearly from 0 at this
            specificity (`1 - cos` between its q and the other rewards' mean q, a running mean over train batches)
            to 1 at twice it; a reward whose `g_k` is 0 is replayed only every 10th generation batch after
            warm-up. Logged as `mrtpo/beta/<reward>`. `None`: every reward uses `credit_beta` (the published rule).
            Acts in `"mrtpo"` mode; in (0, 0.5].
        > Parameters that control the replay

        replay_batch_size (`int`, *optional*, defaults to `8`):
            Sequences per padded replay forward (packed rows run alone).
        replay_only_varying (`bool`, *optional*, defaults to `True`):
            Replay only the (response, reward) pairs whose reward varies within the group; the others cannot
            change the advantage. `False` replays every pair that has an info block (for analysis).
        replay_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Completion tokens per divergence chunk; `None`: on CUDA 2,048 fp32 vocabulary rows (the torch rule holds
            `3K + 1` a token, the kernel `K + 1`) within a quarter of the memory free when the run first replays,
            fixed for the run (docs/kernels.md); on CPU about 2M logits at once.
        divergence_backend (`str`, *optional*, defaults to `"auto"`):
            `"torch"` (chunked), `"triton"` (cuBLAS logits and a Triton row kernel, CUDA, needs the `kernels` extra;
            checked against the torch rule at start-up on near and far contexts at the lm_head's shape), or `"auto"`:
            on CUDA the kernel when it passes that check and is faster on the real shape, else torch.
        info_block_separator (`str`, *optional*, defaults to `"\n\n"`):
            Text placed between the prompt and each appended info block.
        > Parameters that control process rewards

        process_reward_weights (`list[float]` or `None`, *optional*, defaults to `None`):
            Weight of each process reward (the trainer's `process_rewards`, step-level scores turned into token
            advantages by GRPO's process-supervision rule and added to the outcome rewards' credit); `None`: 1 each.
        > Parameters that control the diagnostics

        collapse_warning_steps (`int`, *optional*, defaults to `5`):
            Warn when a reward's replayed q stays below 1e-6 for this many consecutive generation steps (its
            credit is then uniform, i.e. plain GDPO). 0 disables the warning.
    """

    # transformers renamed gradient_checkpointing (after 5.17); TRL still defaults the old name to True, which warns at
    # every config. Same default under the current name; the old one, when a user sets it, still wins (with the
    # warning). An older transformers (the one vLLM pins) reads the old name only: the choice is passed to it there.
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated name of activation_checkpointing (transformers 5)."}
    )
    activation_checkpointing: bool | None = field(
        default=True, metadata={"help": "Recompute activations in the backward pass to save memory."}
    )
    # Parameters that control the credit assignment
    credit_assignment: str = field(
        default="mrtpo",
        metadata={
            # no argparse choices: a rule registered after this class is made is chosen by name too
            "help": "Where each reward's credit lands: 'mrtpo', 'gdpo' (uniform per-reward normalisation), 'grpo' "
            "(plain GRPOTrainer), another registered credit rule, or a rule's dotted import path."
        },
    )
    credit_beta: float = field(
        default=0.5,
        metadata={"help": "Redistribution strength in [0, 1]; every token keeps at least 1 - credit_beta."},
    )
    credit_warmup_steps: float = field(
        default=10,
        metadata={"help": "Steps over which credit_beta ramps up from 0 (smoothstep); below 1: a share of max_steps."},
    )
    max_second_moment_ratio: float = field(
        default=2.0,
        metadata={"help": "Cap rho >= 1 on the token-advantage second moment relative to uniform spreading."},
    )
    reward_strength_floor: float | None = field(
        default=0.25,
        metadata={
            "help": "Per-reward strength: specificity in (0, 0.5] at or below which a reward's beta is 0 (full "
            "credit_beta from twice it); None: one beta for every reward."
        },
    )
    # Parameters that control the replay
    replay_batch_size: int = field(
        default=REPLAY_BATCH_SIZE, metadata={"help": "Sequences per padded replay forward (packed rows run alone)."}
    )
    replay_only_varying: bool = field(
        default=True,
        metadata={"help": "Replay only (response, reward) pairs whose reward varies in the group."},
    )
    replay_chunk_size: int | None = field(
        default=None,
        metadata={
            "help": "Completion tokens per divergence chunk; None: on CUDA 2,048 fp32 vocabulary rows within a "
            "quarter of the memory free when the run first replays, ~2M logits on CPU."
        },
    )
    divergence_backend: str = field(
        default="auto",
        metadata={"help": "JS divergence backend: auto (the kernel on CUDA when it proves itself), triton or torch."},
    )
    info_block_separator: str = field(
        default="\n\n", metadata={"help": "Text between the prompt and each appended info block."}
    )

    # Parameters that control process rewards
    process_reward_weights: list[float] | None = field(
        default=None,
        metadata={"help": "Weight of each process reward (trainer argument process_rewards); None: 1 each."},
    )
    # Parameters that control the diagnostics
    collapse_warning_steps: int = field(
        default=5,
        metadata={"help": "Warn when a reward's replayed q stays below 1e-6 this many steps in a row (0: never)."},
    )

    def __post_init__(self):
        # NaN passes every range check below (each comparison is False): refuse non-finite numbers first, by name.
        own = [name for name in self.__dataclass_fields__ if name not in GRPOConfig.__dataclass_fields__]
        check_field_types(self, [*own, "temperature", "reward_weights"])
        check_finite_fields(self, [*own, "temperature"])
        if self.gradient_checkpointing is not None:
            if RENAMED_CHECKPOINTING:
                warnings.warn(
                    "`gradient_checkpointing` is deprecated (transformers 5); use `activation_checkpointing` instead.",
                    FutureWarning,
                    stacklevel=3,
                )
            self.activation_checkpointing = self.gradient_checkpointing
        if not RENAMED_CHECKPOINTING:
            self.gradient_checkpointing = self.activation_checkpointing
        super().__post_init__()
        check_config_ranges(self)
