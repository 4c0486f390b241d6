"""The research room's trainer: MRTPO plus the sibling methods (CoRT, SAW, CONCUR, TACO), the ablations (``joint``,
``shuffled``) and the calibrated-credit options that stayed options (null correction, preserved totals).

Each is a credit rule registered by :mod:`trl_mrtpo.research.rules` or a term this class passes as its
configuration selects it; it replays with its prefix option and computes the two quantities only the research room
reads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .._trl import whole_policy
from ..batch import ScoredBatch
from ..constants import MIN_SHARED_PREFIX, REPLAY_BATCH_SIZE
from ..relevance import ReplayRelevance
from ..replay import final_logit_softcap, lm_head_parameters
from ..rules import CreditTerm, given_terms
from ..sequence_states import replayed_hidden_states
from ..trainer import MRTPOTrainer
from .config import ResearchConfig
from .rules import CONFIGURED_TERMS
from .token_scores import sampled_logprobs


def completion_token_lists(output: dict) -> list[list[int]]:
    """Each completion's token ids without padding, from TRL's generation output."""
    lengths = output["completion_mask"].sum(-1).tolist()
    return [ids[:length].tolist() for ids, length in zip(output["completion_ids"], lengths)]


class ResearchTrainer(MRTPOTrainer):
    """[`MRTPOTrainer`] with the research room's methods and options, set in a [`ResearchConfig`].

    With every option at its default it trains exactly as [`MRTPOTrainer`]. The benchmarks and the credit gym
    compare MRTPO against what is here; see `docs/sibling-methods.md` and `benchmarks/`.
    """

    _tag_names = ["trl", "grpo", "mrtpo", "mrtpo-research"]
    _name = "MRTPO-research"
    config_class = ResearchConfig

    def __init__(self, *args, credit_terms: Sequence[CreditTerm] | None = None, **kwargs):
        # the configured terms reach the rule as the user's do: classes built from the run's setup (None: not selected)
        super().__init__(*args, credit_terms=[*CONFIGURED_TERMS, *given_terms(credit_terms)], **kwargs)

    def _replay_relevance(self, args: ResearchConfig) -> ReplayRelevance:
        return ReplayRelevance(**self._replay_options(args))

    def _quantity(self, name: str, batch: ScoredBatch):
        """CoRT's ``logprob_contrast`` and TACO's ``surprisal`` (methods subclasses may instrument)."""
        if name == "logprob_contrast":
            return self._cort_contrast(batch)
        if name == "surprisal":
            return self._surprisal(batch.output)
        return super()._quantity(name, batch)

    def _replay_options(self, args: ResearchConfig | None = None) -> dict:
        args = args or self.args
        return {"batch_size": args.replay_batch_size, "min_shared_prefix": args.replay_min_shared_prefix}

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


@torch.no_grad()
def replay_logprobs(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    batch_size: int = REPLAY_BATCH_SIZE,
    min_shared_prefix: int | None = MIN_SHARED_PREFIX,
) -> list[torch.Tensor]:
    """Log-probabilities of the sampled completion tokens after each context (CoRT's contrast, TACO's surprisal).

    Args:
        contexts: per response j, a list of context token ids (empty: skipped).
        completions: per response j, its completion token ids.
        (the other arguments as in :func:`replay_relevance`)

    Returns:
        per response j, ``[len(contexts[j]), L_j]`` fp32 log-probabilities (``[0, L_j]`` when skipped).
    """
    hidden, owners = replayed_hidden_states(
        model, contexts, completions, batch_size, min_shared_prefix, min_contexts=1
    )
    results = [torch.zeros(0, len(c)) for c in completions]
    if not owners:
        return results
    # One call over every sequence of the batch (the lm_head weight is read, and upcast, once).
    states = torch.cat(hidden)
    token_ids = torch.tensor(
        [token for j, count, _ in owners for token in list(completions[j]) * count], device=states.device
    )
    with lm_head_parameters(model) as (weight, bias):
        logprobs = sampled_logprobs(states, token_ids, weight, bias, temperature, softcap=final_logit_softcap(model))
    parts = logprobs.split([count * len(completions[j]) for j, count, _ in owners])
    for (j, count, _), part in zip(owners, parts):
        results[j] = part.view(count, -1)
    return results
