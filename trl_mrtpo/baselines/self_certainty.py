"""INTUITOR's self-certainty as a reward function: the policy's own confidence, no external verifier.

``self_certainty(y) = 1/T sum_t KL(U || pi(. | x, y_<t))`` over the full vocabulary (INTUITOR's definition; the
direction matters: it is neither ``KL(pi || U)`` nor the negative entropy). It is an intrinsic signal, not a
correctness check: a model can be confidently wrong, so evaluate on held-out tasks.
"""

from __future__ import annotations

import torch

from .._trl import tokenize_prompts
from ..constants import MIN_SHARED_PREFIX, REPLAY_BATCH_SIZE
from ..ops import self_certainty
from ..replay import lm_head_parameters, replayed_hidden_states


class SelfCertaintyReward:
    """Reward function (TRL signature) scoring each completion by the policy's self-certainty, in nats.

    It needs the policy: :class:`trl_mrtpo.MRTPOTrainer` binds itself at init; with another trainer call
    ``reward.bind(trainer)`` after building it. Scored with the current weights, no grad, dropout off, at the
    trainer's sampling temperature (divided by the logit multiplier of a model that scales its logits in forward).

    Args:
        batch_size: sequences per no-grad forward.
    """

    runs_policy_forwards = True  # it scores with the policy (refused under parameter sharding)

    def __init__(self, batch_size: int = REPLAY_BATCH_SIZE):
        self.__name__ = "self_certainty"  # TRL names reward functions by __name__
        self.batch_size = batch_size
        self._trainer = None

    def bind(self, trainer) -> SelfCertaintyReward:
        """Score with ``trainer``'s policy, tokenizer and temperature."""
        self._trainer = trainer
        return self

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, completion_ids: list, **kwargs) -> list[float | None]:
        if self._trainer is None:
            raise RuntimeError(
                "SelfCertaintyReward scores with the policy: use it with MRTPOTrainer (which binds it), "
                "or call reward.bind(trainer) after building your trainer."
            )
        trainer = self._trainer
        prompt_ids = tokenize_prompts(trainer, prompts)
        model = trainer.accelerator.unwrap_model(trainer.model)
        # The G completions of a prompt share it: it is run once and reused as a key/value cache.
        hidden, owners = replayed_hidden_states(
            model, [[ids] for ids in prompt_ids], completion_ids, self.batch_size, MIN_SHARED_PREFIX, min_contexts=1
        )
        scores: list[float | None] = [None] * len(completion_ids)  # empty completion: nothing to be certain about
        if not owners:
            return scores
        with lm_head_parameters(model) as (weight, bias):
            # the sampling distribution: a model that scales its logits in forward is scored at T / m, as replayed
            certainty = self_certainty(torch.cat(hidden), weight, bias, trainer._replay_temperature)
        for (j, _, _), part in zip(owners, certainty.split([len(h) for h in hidden])):
            scores[j] = part.mean().item()
        return scores
