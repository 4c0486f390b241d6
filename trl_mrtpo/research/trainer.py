"""The research room's trainer: MRTPO plus the sibling methods (CoRT, SAW, CONCUR, TACO), the ablations (``joint``,
``shuffled``) and the calibrated-credit options that stayed options (null correction, preserved totals).

Each acts through one of :class:`~trl_mrtpo.MRTPOTrainer`'s steps (response weighting, placed relevance, the
advantages, the resting rewards, the state a checkpoint keeps); the core never reads these options.
"""

from __future__ import annotations

import copy
import math
import numbers
import typing
from dataclasses import asdict
from typing import Any

import torch

from .._trl import whole_policy
from ..batch import CREDIT_MODES, CreditMode, ScoredBatch, completion_token_lists
from ..credit import TokenCredit, weighted_token_advantages
from ..credit_state import StateCheck
from ..replay import replay_logprobs
from ..trainer import MRTPOTrainer
from .config import ResearchConfig
from .credit import (
    cort_weights,
    null_corrected_relevance,
    shuffle_relevance,
    taco_scale,
    token_advantages_preserving_totals,
)
from .weighting import ConcurTrust, concur_advantages, saw_weights

RESEARCH_CREDIT_MODES = {
    **CREDIT_MODES,
    "joint": CreditMode("all"),
    "shuffled": CreditMode("each", shuffled=True),
    "cort": CreditMode("all", contrast=True),
}


def concur_trust_problem(trust: Any, num_rewards: int) -> str | None:
    """CONCUR-A's trust records: auxiliary reward -> the fields of :class:`ConcurTrust`, finite numbers."""
    if not isinstance(trust, dict):
        return type(trust).__name__
    fields = typing.get_type_hints(ConcurTrust)
    for key, record in trust.items():
        if not isinstance(record, dict) or set(record) != set(fields):
            return f"[{key!r}] = {record}"
        for name, kind in fields.items():
            value = record[name]
            finite = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            if not finite or (kind is int and value != int(value)):
                return f"[{key!r}].{name} = {value!r}"
    return None


def shuffle_generator_problem(generator: Any, num_rewards: int) -> str | None:
    expected = torch.Generator().get_state()
    if isinstance(generator, torch.Tensor) and generator.dtype == expected.dtype and generator.shape == expected.shape:
        return None
    return str(getattr(generator, "shape", type(generator).__name__))


RESEARCH_STATE_ENTRIES: dict[str, StateCheck] = {
    "concur_trust": concur_trust_problem,
    "shuffle_generator": shuffle_generator_problem,
}


class ResearchTrainer(MRTPOTrainer):
    """[`MRTPOTrainer`] with the research room's methods and options, set in a [`ResearchConfig`].

    With every option at its default it trains exactly as [`MRTPOTrainer`]. The benchmarks and the credit gym
    compare MRTPO against what is here; see `docs/sibling-methods.md` and `benchmarks/`.
    """

    _tag_names = ["trl", "grpo", "mrtpo", "mrtpo-research"]
    credit_modes = RESEARCH_CREDIT_MODES
    accepts_research = True

    _name = "MRTPO-research"
    config_class = ResearchConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        args = self.args
        self._shuffle_generator = torch.Generator().manual_seed(args.seed)
        self._concur_trust: dict = {}  # CONCUR-A's cumulative readings per auxiliary reward (train batches only)
        self._concur_primary = 0
        if args.concur_primary is not None:
            if args.concur_primary not in self.reward_func_names:
                raise ValueError(
                    f"concur_primary={args.concur_primary!r} is not a reward function; "
                    f"they are {', '.join(self.reward_func_names)}."
                )
            self._concur_primary = self.reward_func_names.index(args.concur_primary)

    def _extra_policy_forwards(self) -> list[str]:
        return ["taco_strength"] if self.args.taco_strength > 0 else []

    def _replay_options(self) -> dict:
        return {"batch_size": self.args.replay_batch_size, "min_shared_prefix": self.args.replay_min_shared_prefix}

    # ------------------------------------------------------------------ response-level weighting (SAW, CONCUR)
    def _response_weighting(self, rewards, group_adv, num_generations, mode):
        group_adv, reward_weights = super()._response_weighting(rewards, group_adv, num_generations, mode)
        if self.args.reward_weighting == "saw":
            reward_weights = reward_weights * saw_weights(rewards).to(group_adv)
        elif self.args.reward_weighting == "concur":
            # Evaluation reads CONCUR-A's trust but never adds to it.
            trust = self._concur_trust if mode == "train" else copy.deepcopy(self._concur_trust)
            group_adv = concur_advantages(
                rewards,
                group_adv,
                num_generations,
                self._concur_primary,
                self.args.concur_pass_threshold,
                self.args.concur_ceiling,
                self.args.concur_ceiling_mode,
                trust,
                self.args.concur_min_readings,
            )
        return group_adv, reward_weights

    # ------------------------------------------------------------------ token credit (CoRT, TACO, options)
    def _token_credit(self, batch: ScoredBatch, beta: float, step_credit: dict):
        if self._credit_mode.contrast:
            credit, relevance, replayed = self._cort_credit(batch, beta, step_credit)
        else:
            credit, relevance, replayed = super()._token_credit(batch, beta, step_credit)
        if self.args.taco_strength > 0:
            with self._replay_clock():
                surprisal = self._surprisal(batch.output)
            credit.advantages = taco_scale(
                credit.advantages,
                surprisal,
                self.args.taco_strength,
                self.args.taco_threshold,
                self.args.taco_sharpness,
            )
        return credit, relevance, replayed

    def _advantages(self, batch: ScoredBatch, relevance, replayed, betas, step_credit: dict) -> TokenCredit:
        if not self.args.preserve_reward_totals:
            return super()._advantages(batch, relevance, replayed, betas, step_credit)
        return token_advantages_preserving_totals(
            batch.group_advantages,
            relevance,
            replayed,
            batch.mask,
            batch.reward_weights,
            betas,
            self.args.max_second_moment_ratio,
            self._reduce_sum(),
            **step_credit,
        )

    def _placed_relevance(self, relevance, replayed, batch: ScoredBatch) -> torch.Tensor:
        """Null correction (docs/method.md, "Calibrated credit"), after the strength reading; ``shuffled`` permutes
        what is left."""
        if self.args.relevance_null_correction:
            relevance = null_corrected_relevance(relevance, replayed)
        if self._credit_mode.shuffled:
            relevance = shuffle_relevance(relevance, batch.mask, self._shuffle_generator)
        return relevance

    def _cort_credit(self, batch: ScoredBatch, beta: float, step_credit: dict):
        """CoRT: one weight profile per response from its log-likelihood contrast, applied to every reward."""
        relevance = batch.mask.new_zeros((*batch.varying.shape, batch.mask.shape[1]), dtype=torch.float32)
        weights = torch.ones_like(relevance)
        replayed = torch.zeros_like(batch.varying)
        if self._replays and beta > 0:
            with self._replay_clock():
                contrast, cort_replayed = self._cort_contrast(batch)
            profile = cort_weights(
                contrast, batch.mask, self.args.cort_eta * beta, self.args.cort_tau, self.args.cort_offset
            )
            weights = torch.where(cort_replayed[:, None, None], profile[:, None, :], weights)
            replayed = cort_replayed[:, None] & batch.varying
        credit = weighted_token_advantages(
            batch.group_advantages, weights, batch.mask, batch.reward_weights, None, self._reduce_sum(), **step_credit
        )
        return credit, relevance, replayed

    def _cort_contrast(self, batch: ScoredBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """CoRT's ``[B, C]`` contrast ``log pi(y_t | P_all) - log pi(y_t | every block removed)`` and which responses
        were replayed (those with a varying reward that has a block)."""
        _, context_ids, completion_ids = self._replay_inputs(batch, joint=True)
        mask = batch.mask
        contrast = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        replayed = torch.zeros(mask.shape[0], dtype=torch.bool, device=mask.device)
        with whole_policy(self) as policy:
            logprobs = replay_logprobs(
                policy, context_ids, completion_ids, self._replay_temperature, **self._replay_options()
            )
        for i, lp in enumerate(logprobs):
            if lp.shape[0] == 2:
                contrast[i, : lp.shape[1]] = (lp[0] - lp[1]).to(mask.device)
                replayed[i] = True
        return contrast, replayed

    def _surprisal(self, output):
        """``[B, C]`` ``-log pi_old(y_t)`` of the sampled tokens at the sampling temperature (TACO's risk proxy):
        TRL's old log-probabilities when it computed them, else one no-grad forward of the prompt + completion."""
        mask = output["completion_mask"]
        if output.get("old_per_token_logps") is not None:
            return -output["old_per_token_logps"].float() * mask
        prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(output["prompt_ids"], output["prompt_mask"])]
        with whole_policy(self) as policy:
            logprobs = replay_logprobs(
                policy,
                [[p] for p in prompt_ids],
                completion_token_lists(output),
                self._replay_temperature,
                **self._replay_options(),
            )
        surprisal = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        for i, lp in enumerate(logprobs):
            if lp.shape[0]:
                surprisal[i, : lp.shape[1]] = -lp[0].to(mask.device)
        return surprisal

    # ------------------------------------------------------------------ checkpointed state and logs
    def _state_identity(self) -> dict:
        return {
            **super()._state_identity(),
            "reward_weighting": self.args.reward_weighting,
            "concur_primary": self._concur_primary,
        }

    def _credit_state(self) -> tuple[dict, dict[str, StateCheck]]:
        state, entries = super()._credit_state()
        state = {
            **state,
            "concur_trust": {k: asdict(trust) for k, trust in self._concur_trust.items()},
            "shuffle_generator": self._shuffle_generator.get_state(),
        }
        return state, {**entries, **RESEARCH_STATE_ENTRIES}

    def _restore_credit_state(self, state: dict) -> None:
        super()._restore_credit_state(state)
        self._concur_trust = {k: ConcurTrust(**trust) for k, trust in state["concur_trust"].items()}
        self._shuffle_generator.set_state(state["shuffle_generator"])
