"""Configuration of :class:`trl_mrtpo.research.ResearchTrainer`: MRTPO's configuration plus the sibling methods, the
ablations and the calibrated-credit options."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..checks.inputs import options_beyond
from ..config import MRTPOConfig
from ..constants import MIN_SHARED_PREFIX

RESEARCH_CREDIT_ASSIGNMENTS = ("joint", "shuffled", "cort")  # the rules research/rules.py registers
REWARD_WEIGHTINGS = ("static", "saw", "concur")
CONCUR_CEILING_MODES = ("adaptive", "tie", "none")
# CONCUR-A: concordance readings needed before the ceiling tie may be released (concur_min_readings).
CONCUR_MIN_READINGS = 61


def needs_research(settings: Mapping[str, Any]) -> bool:
    """Whether configuration fields ``settings`` ask for the research room: a research credit mode, or a field
    :class:`~trl_mrtpo.MRTPOConfig` does not have."""
    core = MRTPOConfig.__dataclass_fields__
    return settings.get("credit_assignment") in RESEARCH_CREDIT_ASSIGNMENTS or any(
        name not in core for name in settings
    )


def arm_settings(options: Mapping[str, Any]) -> dict[str, Any]:
    """Configuration fields of a benchmark arm's ``options``. The benchmarks' arms keep the names their committed
    run records carry: ``mrtpo`` is the published rule (``reward_strength_floor=None``), and per-reward strength is
    the option ``reward_strength=True`` (with its ``reward_strength_floor``), as it was before it became the
    default."""
    settings = dict(options)
    strength = settings.pop("reward_strength", False)
    floor = settings.pop("reward_strength_floor", MRTPOConfig.reward_strength_floor)
    return {**settings, "reward_strength_floor": floor if strength else None}


@dataclass
class ResearchConfig(MRTPOConfig):
    r"""
    Configuration class for [`ResearchTrainer`].

    Inherits every parameter of [`MRTPOConfig`] (and so of [`trl.GRPOConfig`]). What is here did not earn a place in
    MRTPO's core: the sibling methods the benchmarks compare against, the ablations, and our calibrated-credit
    options, each with its results in `benchmarks/`. Every option is off by default, where this configuration
    trains exactly as [`MRTPOConfig`] does.

    Parameters:
        > Parameters that control the credit assignment

        credit_assignment (`str`, *optional*, defaults to `"mrtpo"`):
            MRTPO's modes (`"mrtpo"`, `"gdpo"`, `"grpo"`) and three more. `"joint"`: ablation with one replay that
            removes every block at once, its q shared by all rewards. `"shuffled"`: ablation with the q values
            permuted within each response. `"cort"`: CoRT, one replay without any info block; the aggregated
            advantage is reweighted per token by the sampled token's log-likelihood contrast (`cort_*`).
        > Parameters that control the replay

        replay_min_shared_prefix (`int` or `None`, *optional*, defaults to `16`):
            The replay's contexts form a prefix tree (a group's prompt, everything before a removed block, the
            identical contexts of a group's responses); a shared prefix with at least this many new tokens runs
            once and its key/value cache is reused. `None` turns prefix reuse off (the replay-scaling benchmark's
            reference).
        > Parameters that control the sibling methods (CoRT, SAW, CONCUR, TACO)

        cort_eta (`float`, *optional*, defaults to `1.0`):
            CoRT strength eta in [0, 2): token weights before normalisation are `1 + eta * lambda_n * s_t`, with
            `lambda_n` the `credit_warmup_steps` ramp from 0 to 1.
        cort_tau (`float`, *optional*, defaults to `1.0`):
            CoRT sharpness tau of `s_t = sigmoid(tau * (delta_t - b)) - 1/2`.
        cort_offset (`float`, *optional*, defaults to `0.0`):
            CoRT offset b (nats of log-likelihood contrast).
        reward_weighting (`str`, *optional*, defaults to `"static"`):
            How much each reward counts, stacking with every credit mode: `"static"` (`reward_weights`), `"saw"`
            (`reward_weights` times `K * CV_k / sum CV` from the batch's coefficients of variation) or `"concur"`
            (auxiliary advantages projected onto the primary reward's order per group).
        concur_primary (`str` or `None`, *optional*, defaults to `None`):
            Name of CONCUR's primary reward; `None`: the first reward function.
        concur_pass_threshold (`float`, *optional*, defaults to `1.0`):
            A response passes when its primary reward is at least this; auxiliary rewards of failing responses are
            gated to 0.
        concur_ceiling (`float`, *optional*, defaults to `1.0`):
            Primary reward at which a response is at the ceiling.
        concur_ceiling_mode (`str`, *optional*, defaults to `"adaptive"`):
            `"tie"`: responses at the ceiling share one auxiliary advantage (CONCUR-T); `"adaptive"`: tie unless the
            cumulative concordance readings trust the auxiliary reward (CONCUR-A); `"none"`: never tie.
        concur_min_readings (`int`, *optional*, defaults to `61`):
            Readings CONCUR-A needs before it may release the ceiling tie.
        taco_strength (`float`, *optional*, defaults to `0.0`):
            TACO-style calibration in [0, 1]: positive token advantages are scaled by
            `1 - taco_strength * sigmoid(taco_sharpness * (surprisal - taco_threshold))`; negative ones untouched.
            0 disables it (and its extra forward).
        taco_threshold (`float`, *optional*, defaults to `4.0`):
            Surprisal (nats, `-log pi_old` of the sampled token) at which the scaling is half way.
        taco_sharpness (`float`, *optional*, defaults to `1.0`):
            Slope of the sigmoid in surprisal.
        > Parameters that control calibrated credit (our extension of MRTPO; all off by default)

        relevance_null_correction (`bool`, *optional*, defaults to `False`):
            Subtract from each reward's q the pointwise minimum of the other replayed rewards' q of the same
            response (the background every removal shares), floored at 0. No extra forward.
        preserve_reward_totals (`bool`, *optional*, defaults to `False`):
            Cap each reward's redistribution on its own and rescale by the std of uniform spreading, so every
            reward's total credit per response equals what GDPO gives it.
    """

    room: ClassVar[str] = "the research room"  # named when MRTPOTrainer refuses these options
    room_trainer: ClassVar[str] = "trl_mrtpo.research.ResearchTrainer"

    credit_assignment: str = field(
        default="mrtpo",
        metadata={
            "help": "Where each reward's credit lands: 'mrtpo', 'gdpo', 'grpo', 'joint' or 'shuffled' (ablations), "
            "'cort' (CoRT), or another registered credit rule."
        },
    )
    replay_min_shared_prefix: int | None = field(
        default=MIN_SHARED_PREFIX,
        metadata={
            "help": "Fewest new tokens a shared context prefix needs to run once as a KV cache; None: no reuse."
        },
    )
    # Parameters that control the sibling methods (CoRT, SAW, CONCUR, TACO)
    cort_eta: float = field(default=1.0, metadata={"help": "CoRT strength eta in [0, 2)."})
    cort_tau: float = field(default=1.0, metadata={"help": "CoRT sigmoid sharpness tau."})
    cort_offset: float = field(default=0.0, metadata={"help": "CoRT contrast offset b (nats)."})
    reward_weighting: str = field(
        default="static",
        metadata={
            "help": "Response-level reward weighting: 'static' (reward_weights), 'saw' (batch CV) or 'concur'.",
            "choices": list(REWARD_WEIGHTINGS),
        },
    )
    concur_primary: str | None = field(
        default=None, metadata={"help": "CONCUR's primary reward (function name); None: the first."}
    )
    concur_pass_threshold: float = field(
        default=1.0, metadata={"help": "Primary reward at which a response passes (auxiliaries count)."}
    )
    concur_ceiling: float = field(default=1.0, metadata={"help": "Primary reward at the ceiling."})
    concur_ceiling_mode: str = field(
        default="adaptive",
        metadata={
            "help": "Ceiling tie: 'adaptive' (CONCUR-A), 'tie' (CONCUR-T) or 'none'.",
            "choices": list(CONCUR_CEILING_MODES),
        },
    )
    concur_min_readings: int = field(
        default=CONCUR_MIN_READINGS,
        metadata={"help": "Concordance readings CONCUR-A needs before releasing the ceiling tie."},
    )
    taco_strength: float = field(
        default=0.0, metadata={"help": "TACO down-weighting of positive advantages on surprising tokens, in [0, 1]."}
    )
    taco_threshold: float = field(default=4.0, metadata={"help": "TACO surprisal midpoint (nats)."})
    taco_sharpness: float = field(default=1.0, metadata={"help": "TACO sigmoid slope in surprisal."})
    # Parameters that control calibrated credit
    relevance_null_correction: bool = field(
        default=False,
        metadata={"help": "Subtract the other replayed rewards' pointwise minimum q from each reward's q."},
    )
    preserve_reward_totals: bool = field(
        default=False,
        metadata={"help": "Cap each reward on its own and rescale by the uniform std: GDPO's total per reward."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.replay_min_shared_prefix is not None and self.replay_min_shared_prefix < 1:
            raise ValueError(f"replay_min_shared_prefix must be >= 1 or None, got {self.replay_min_shared_prefix}.")
        if not 0.0 <= self.cort_eta < 2.0:
            raise ValueError(f"cort_eta must be in [0, 2) (weights stay positive), got {self.cort_eta}.")
        if self.reward_weighting not in REWARD_WEIGHTINGS:
            raise ValueError(
                f"reward_weighting={self.reward_weighting!r} is unknown; choose one of {', '.join(REWARD_WEIGHTINGS)}."
            )
        if self.concur_ceiling_mode not in CONCUR_CEILING_MODES:
            raise ValueError(
                f"concur_ceiling_mode must be one of {', '.join(CONCUR_CEILING_MODES)}, "
                f"got {self.concur_ceiling_mode!r}."
            )
        if self.concur_min_readings < 2:
            raise ValueError(f"concur_min_readings must be >= 2, got {self.concur_min_readings}.")
        if not 0.0 <= self.taco_strength <= 1.0:
            raise ValueError(f"taco_strength must be in [0, 1], got {self.taco_strength}.")
        if self.credit_assignment == "grpo" and (self.reward_weighting != "static" or self.taco_strength > 0):
            raise ValueError(
                "reward_weighting and taco_strength act on MRTPO's per-reward and token advantages; "
                "credit_assignment='grpo' is plain GRPOTrainer. Use 'gdpo' for uniform credit with them."
            )
        if self.relevance_null_correction and self.credit_assignment not in ("mrtpo", "shuffled"):
            raise ValueError(
                "relevance_null_correction acts on each reward's own q profile, which only credit_assignment='mrtpo' "
                f"(or its 'shuffled' ablation) computes; got credit_assignment={self.credit_assignment!r}."
            )
        self._check_scopes()

    def research_settings(self) -> list[str]:
        """What this configuration asks of the research room: a research credit mode, and every research option
        set away from its default (an :class:`~trl_mrtpo.MRTPOTrainer` refuses them rather than ignore them)."""
        return options_beyond(self, MRTPOConfig)

    def _check_scopes(self) -> None:
        """Refuse an option set away from its default in a configuration where it does nothing (it would be ignored
        silently: a user would believe it acts)."""
        mode = self.credit_assignment
        groups = [
            (
                ("preserve_reward_totals",),
                mode in ("mrtpo", "joint", "shuffled"),
                "credit_assignment 'mrtpo', 'joint' or 'shuffled'",
            ),
            (("cort_eta", "cort_tau", "cort_offset"), mode == "cort", "credit_assignment='cort'"),
            (("taco_threshold", "taco_sharpness"), self.taco_strength > 0, "taco_strength > 0"),
            (
                (
                    "concur_primary",
                    "concur_pass_threshold",
                    "concur_ceiling",
                    "concur_ceiling_mode",
                    "concur_min_readings",
                ),
                self.reward_weighting == "concur",
                "reward_weighting='concur'",
            ),
        ]
        for names, acts, condition in groups:
            set_here = [name for name in names if getattr(self, name) != self.__dataclass_fields__[name].default]
            if set_here and not acts:
                name, value = set_here[0], getattr(self, set_here[0])
                raise ValueError(
                    f"{name}={value!r} has no effect unless {condition} (credit_assignment={mode!r}, "
                    f"reward_weighting={self.reward_weighting!r}, taco_strength={self.taco_strength}); remove it "
                    "or set what it needs."
                )
