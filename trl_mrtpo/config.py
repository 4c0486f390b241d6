"""Configuration of :class:`trl_mrtpo.MRTPOTrainer`."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

CREDIT_ASSIGNMENTS = ("mrtpo", "gdpo", "grpo", "joint", "shuffled")


@dataclass
class MRTPOConfig(GRPOConfig):
    r"""
    Configuration class for [`MRTPOTrainer`].

    Inherits every parameter of [`trl.GRPOConfig`]. Note that `beta` there is still the KL coefficient; the credit
    redistribution strength of MRTPO is `credit_beta`.

    Parameters:
        credit_assignment (`str`, *optional*, defaults to `"mrtpo"`):
            Where each reward's credit lands. `"mrtpo"`: each reward's advantage is redistributed over the tokens
            its info block makes the policy change its mind on. `"gdpo"`: per-reward group normalisation, uniform
            over tokens (the same pipeline with `credit_beta=0`). `"grpo"`: plain `GRPOTrainer` behaviour
            (`multi_objective_aggregation` as set). `"joint"`: ablation with one replay that removes every block
            at once, its q shared by all rewards. `"shuffled"`: ablation with the q values permuted within each
            response.
        credit_beta (`float`, *optional*, defaults to `0.5`):
            Redistribution strength in [0, 1]: every token keeps at least `1 - credit_beta` of the uniform credit.
        credit_warmup_steps (`int`, *optional*, defaults to `10`):
            Optimizer steps over which `credit_beta` ramps up smoothly from 0 (`3u^2 - 2u^3`). 0 disables warm-up.
        max_second_moment_ratio (`float`, *optional*, defaults to `2.0`):
            Cap rho: the batch's token-advantage second moment stays at most rho times that of uniform spreading.
        replay_batch_size (`int`, *optional*, defaults to `8`):
            Sequences per no-grad replay forward.
        replay_only_varying (`bool`, *optional*, defaults to `True`):
            Replay only the (response, reward) pairs whose reward varies within the group; the others cannot
            change the advantage. `False` replays every pair that has an info block (for analysis).
        replay_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Completion tokens per divergence chunk; `None` picks it to keep about 2M logits in memory at once.
        info_block_separator (`str`, *optional*, defaults to `"\n\n"`):
            Text placed between the prompt and each appended info block.
        collapse_warning_steps (`int`, *optional*, defaults to `5`):
            Warn when a reward's replayed q stays below 1e-6 for this many consecutive generation steps (its
            credit is then uniform, i.e. plain GDPO). 0 disables the warning.
        save_credit_plots (`bool`, *optional*, defaults to `True`):
            At the end of training, save `mrtpo_curves.png` in `output_dir`: per reward, its mean and the share of
            tokens holding 80 % of its q mass, per step (needs matplotlib).
    """

    credit_assignment: str = field(
        default="mrtpo",
        metadata={
            "help": "Where each reward's credit lands: 'mrtpo', 'gdpo' (uniform per-reward normalisation), 'grpo' "
            "(plain GRPOTrainer), 'joint' or 'shuffled' (ablations).",
            "choices": list(CREDIT_ASSIGNMENTS),
        },
    )
    credit_beta: float = field(
        default=0.5,
        metadata={"help": "Redistribution strength in [0, 1]; every token keeps at least 1 - credit_beta."},
    )
    credit_warmup_steps: int = field(
        default=10,
        metadata={"help": "Optimizer steps over which credit_beta ramps up from 0 (smoothstep); 0 disables it."},
    )
    max_second_moment_ratio: float = field(
        default=2.0,
        metadata={"help": "Cap rho >= 1 on the token-advantage second moment relative to uniform spreading."},
    )
    replay_batch_size: int = field(default=8, metadata={"help": "Sequences per no-grad replay forward."})
    replay_only_varying: bool = field(
        default=True,
        metadata={"help": "Replay only (response, reward) pairs whose reward varies in the group."},
    )
    replay_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Completion tokens per divergence chunk; None bounds it to ~2M logits per chunk."},
    )
    info_block_separator: str = field(
        default="\n\n", metadata={"help": "Text between the prompt and each appended info block."}
    )

    collapse_warning_steps: int = field(
        default=5,
        metadata={"help": "Warn when a reward's replayed q stays below 1e-6 this many steps in a row (0: never)."},
    )
    save_credit_plots: bool = field(
        default=True, metadata={"help": "Save per-reward reward and q-concentration curves (PNG) at the end."}
    )

    def __post_init__(self):
        super().__post_init__()
        if self.credit_assignment not in CREDIT_ASSIGNMENTS:
            raise ValueError(
                f"credit_assignment={self.credit_assignment!r} is unknown; "
                f"choose one of {', '.join(CREDIT_ASSIGNMENTS)}."
            )
        if not 0.0 <= self.credit_beta <= 1.0:
            raise ValueError(f"credit_beta must be in [0, 1], got {self.credit_beta}.")
        if self.credit_warmup_steps < 0:
            raise ValueError(f"credit_warmup_steps must be >= 0, got {self.credit_warmup_steps}.")
        if self.max_second_moment_ratio < 1.0:
            raise ValueError(
                "max_second_moment_ratio must be >= 1 (1 forbids any redistribution), "
                f"got {self.max_second_moment_ratio}."
            )
        if self.replay_batch_size < 1:
            raise ValueError(f"replay_batch_size must be >= 1, got {self.replay_batch_size}.")
        if self.collapse_warning_steps < 0:
            raise ValueError(f"collapse_warning_steps must be >= 0, got {self.collapse_warning_steps}.")
        if self.replay_chunk_size is not None and self.replay_chunk_size < 1:
            raise ValueError(f"replay_chunk_size must be >= 1 or None, got {self.replay_chunk_size}.")
