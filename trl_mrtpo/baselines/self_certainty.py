"""INTUITOR's self-certainty as a reward function: the policy's own confidence, no external verifier.

``self_certainty(y) = 1/T sum_t KL(U || pi(. | x, y_<t))`` over the full vocabulary (INTUITOR's definition; the
direction matters: it is neither ``KL(pi || U)`` nor the negative entropy). It is an intrinsic signal, not a
correctness check: a model can be confidently wrong, so evaluate on held-out tasks.
"""

from __future__ import annotations

import math

import torch

from .._trl import tokenize_prompts
from ..constants import MIN_SHARED_PREFIX, REPLAY_BATCH_SIZE, VOCAB_TILE
from ..ops.js import softcapped_
from ..replay import final_logit_softcap, lm_head_parameters
from ..sequence_states import replayed_hidden_states


def self_certainty(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    vocab_chunk_size: int = VOCAB_TILE,
    softcap: float | None = None,
) -> torch.Tensor:
    """``[N]`` INTUITOR's per-token self-certainty ``KL(U || p) = -log V - mean_v log p_v``, that is
    ``log Z - mean_v z_v - log V`` (>= 0, in nats; ``z`` the tempered logits, ``Z`` their normaliser), accumulated
    over vocabulary tiles of ``vocab_chunk_size`` rows cast to fp32 one at a time.

    The direction matters: ``KL(U || p)`` grows with every near-zero probability in the tail; it is neither
    ``KL(p || U)`` nor the negative entropy.
    """
    if hidden.dim() != 2 or hidden.shape[1] != lm_head_weight.shape[1]:
        raise ValueError(
            f"hidden must be [N, H] with H={lm_head_weight.shape[1]} (the lm_head's), got {tuple(hidden.shape)}"
        )
    vocab = lm_head_weight.shape[0]
    states = hidden.float()
    normaliser = torch.full((hidden.shape[0],), -math.inf, device=hidden.device)
    logit_sum = torch.zeros(hidden.shape[0], device=hidden.device)
    for start in range(0, vocab, vocab_chunk_size):
        rows = slice(start, start + vocab_chunk_size)
        bias = None if lm_head_bias is None else lm_head_bias[rows].float()
        logits = torch.nn.functional.linear(states, lm_head_weight[rows].float(), bias)
        softcapped_(logits, softcap, temperature)
        normaliser = torch.logaddexp(normaliser, torch.logsumexp(logits, dim=-1))
        logit_sum += logits.sum(-1)
    return normaliser - logit_sum / vocab - math.log(vocab)


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
            softcap = final_logit_softcap(model)
            certainty = self_certainty(torch.cat(hidden), weight, bias, trainer._replay_temperature, softcap=softcap)
        for (j, _, _), part in zip(owners, certainty.split([len(h) for h in hidden])):
            scores[j] = part.mean().item()
        return scores
