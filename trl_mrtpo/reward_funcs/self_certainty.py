"""INTUITOR's self-certainty as a reward function: the policy's own confidence, no external verifier.

``self_certainty(y) = 1/T sum_t KL(U || pi(. | x, y_<t))`` over the full vocabulary (INTUITOR's definition; the
direction matters: it is neither ``KL(pi || U)`` nor the negative entropy). It is an intrinsic signal, not a
correctness check: a model can be confidently wrong, so evaluate on held-out tasks.
"""

from __future__ import annotations

import torch

from ..ops import self_certainty
from ..replay import MIN_SHARED_PREFIX, completion_hidden_states, lm_head_parameters


class SelfCertaintyReward:
    """Reward function (TRL signature) scoring each completion by the policy's self-certainty, in nats.

    It needs the policy: :class:`trl_mrtpo.MRTPOTrainer` binds itself at init; with another trainer call
    ``reward.bind(trainer)`` after building it. Scored with the current weights, no grad, dropout off, at the
    trainer's sampling temperature.

    Args:
        batch_size: sequences per no-grad forward.
    """

    def __init__(self, batch_size: int = 8):
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
        prompt_ids = trainer._tokenize_prompts(prompts)[0]
        model = trainer.accelerator.unwrap_model(trainer.model)
        # The G completions of a prompt share it: run it once and reuse its key/value cache.
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, ids in enumerate(prompt_ids):
            groups.setdefault(tuple(ids), []).append(i)
        hidden = completion_hidden_states(
            model,
            prompt_ids,
            completion_ids,
            self.batch_size,
            [(len(key) - 1 if len(key) > MIN_SHARED_PREFIX else 0, members) for key, members in groups.items()],
        )
        scores: list[float | None] = []
        with lm_head_parameters(model) as (weight, bias):
            for states in hidden:
                if states.shape[0] == 0:
                    scores.append(None)  # empty completion: no tokens to be certain about
                    continue
                scores.append(self_certainty(states, weight, bias, trainer.temperature).mean().item())
        return scores
