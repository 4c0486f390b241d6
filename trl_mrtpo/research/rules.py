"""The research room's credit rules, registered on import (:mod:`trl_mrtpo.rules`), and its terms (passed by
``ResearchTrainer`` as ``credit_terms`` classes).

Rules (``credit_assignment``, in a :class:`~trl_mrtpo.research.ResearchConfig`): ``joint`` and ``shuffled``
(ablations), ``cort`` (CoRT). Terms, which :class:`~trl_mrtpo.research.ResearchTrainer` passes as its configuration
selects them (``CONFIGURED_TERMS``): ``reward_weighting`` (SAW, CONCUR), ``taco`` (TACO), ``calibrated_credit``
(null correction, preserved totals). Quantities: ``logprob_contrast`` (CoRT) and ``surprisal`` (TACO), computed by
:class:`~trl_mrtpo.research.ResearchTrainer`.
"""

from __future__ import annotations

import copy
from dataclasses import asdict

import torch

from ..rules import (
    MRTPO,
    CreditInputs,
    CreditRule,
    CreditSetup,
    CreditTerm,
    register_credit_rule,
)
from .config import ResearchConfig
from .credit import cort_weights, null_corrected_relevance, preserved_token_advantages, shuffle_relevance, taco_scale
from .weighting import ConcurTrust, concur_advantages, saw_weights


class Joint(MRTPO):
    """Ablation: one replay removes every block at once; its q is shared by all rewards."""

    removal = "all"


class Shuffled(MRTPO):
    """Ablation: each reward's q permuted within each response (its own seeded generator, checkpointed)."""

    state_entries = ("shuffle_generator",)

    def __init__(self, setup: CreditSetup):
        super().__init__(setup)
        self.generator = torch.Generator().manual_seed(setup.args.seed)

    def relevance(self, relevance, replayed, batch):
        return shuffle_relevance(relevance, batch.mask, self.generator)

    def state(self) -> dict:
        return {"shuffle_generator": self.generator.get_state()}

    def restore(self, state: dict) -> None:
        self.generator.set_state(state["shuffle_generator"])


class CoRT(CreditRule):
    """CoRT: one weight profile per response from its log-likelihood contrast with every block removed, applied to
    every reward, uncapped; beta ramps to 1 (CoRT's lambda_n)."""

    removal = "all"
    reads = ("logprob_contrast",)
    full_strength = True
    capped = False

    def weights(self, inputs: CreditInputs) -> torch.Tensor:
        args, batch = self.setup.args, inputs.batch
        weights = torch.ones_like(inputs.relevance)
        if "logprob_contrast" in inputs.quantities:
            contrast, replayed = inputs.quantities["logprob_contrast"]
            profile = cort_weights(contrast, batch.mask, args.cort_eta * inputs.beta, args.cort_tau, args.cort_offset)
            weights = torch.where(replayed[:, None, None], profile[:, None, :], weights)
        return weights

    def replayed(self, inputs: CreditInputs) -> torch.Tensor:
        if "logprob_contrast" not in inputs.quantities:
            return inputs.replayed
        return inputs.quantities["logprob_contrast"][1][:, None] & inputs.batch.varying


class RewardWeighting(CreditTerm):
    """How much each reward counts (SAW, CONCUR; ``static`` leaves TRL's ``reward_weights``). CONCUR-A's trust is
    read on train batches only and checkpointed."""

    name = "reward_weighting"
    state_entries = ("concur_trust",)

    def __init__(self, args: ResearchConfig, reward_names: list[str]):
        self.args = args
        self.trust: dict = {}  # CONCUR-A's cumulative readings per auxiliary reward
        self.primary = 0
        if args.concur_primary is not None:
            if args.concur_primary not in reward_names:
                raise ValueError(
                    f"concur_primary={args.concur_primary!r} is not a reward function; "
                    f"they are {', '.join(reward_names)}."
                )
            self.primary = reward_names.index(args.concur_primary)

    @classmethod
    def build(cls, setup: CreditSetup) -> RewardWeighting | None:
        return cls(setup.args, setup.reward_names) if isinstance(setup.args, ResearchConfig) else None

    def weigh(self, rewards, advantages, reward_weights, num_generations, training):
        args = self.args
        if args.reward_weighting == "saw":
            reward_weights = reward_weights * saw_weights(rewards).to(advantages)
        elif args.reward_weighting == "concur":
            # Evaluation reads CONCUR-A's trust but never adds to it.
            trust = self.trust if training else copy.deepcopy(self.trust)
            advantages = concur_advantages(
                rewards,
                advantages,
                num_generations,
                self.primary,
                args.concur_pass_threshold,
                args.concur_ceiling,
                args.concur_ceiling_mode,
                trust,
                args.concur_min_readings,
            )
        return advantages, reward_weights

    def identity(self) -> dict:
        return {"reward_weighting": self.args.reward_weighting, "concur_primary": self.primary}

    def state(self) -> dict:
        return {"concur_trust": {k: asdict(trust) for k, trust in self.trust.items()}}

    def restore(self, state: dict) -> None:
        self.trust = {k: ConcurTrust(**trust) for k, trust in state["concur_trust"].items()}


class TACO(CreditTerm):
    """TACO: positive advantages down-weighted on surprising tokens (``-log pi_old``), after step 8."""

    name = "taco"
    reads = ("surprisal",)
    token_credit = policy_forwards = ("taco_strength",)

    def __init__(self, args: ResearchConfig):
        self.args = args

    @classmethod
    def build(cls, setup: CreditSetup) -> TACO | None:
        args = setup.args
        return cls(args) if isinstance(args, ResearchConfig) and args.taco_strength > 0 else None

    def finish(self, credit, inputs: CreditInputs):
        args = self.args
        surprisal = inputs.quantities["surprisal"]
        credit.advantages = taco_scale(
            credit.advantages, surprisal, args.taco_strength, args.taco_threshold, args.taco_sharpness
        )
        return credit


class CalibratedCredit(CreditTerm):
    """The calibrated-credit options that stayed options: null correction of q (after the strength reading), and
    every reward's GDPO total preserved (steps 6-8 replaced)."""

    name = "calibrated_credit"

    def __init__(self, args: ResearchConfig):
        self.null_correction = args.relevance_null_correction
        self.combine = preserved_token_advantages if args.preserve_reward_totals else None

    @classmethod
    def build(cls, setup: CreditSetup) -> CalibratedCredit | None:
        args = setup.args
        wanted = isinstance(args, ResearchConfig) and (args.relevance_null_correction or args.preserve_reward_totals)
        return cls(args) if wanted else None

    def relevance(self, relevance, replayed, batch):
        if not self.null_correction:
            return relevance
        return null_corrected_relevance(relevance, replayed, batch.information_groups)


register_credit_rule("joint", Joint, ResearchConfig)
register_credit_rule("shuffled", Shuffled, ResearchConfig)
register_credit_rule("cort", CoRT, ResearchConfig)


# the research room's terms, in a fixed order: each class builds its term when the configuration selects it
CONFIGURED_TERMS = (RewardWeighting, TACO, CalibratedCredit)
