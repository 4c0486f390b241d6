"""Records and statistics of where relevance q lands (training metrics, inspection), and the one-line summary
per response the completions table shows."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from transformers.utils import logging

from . import _trl
from .batch import ScoredBatch
from .credit import TokenCredit
from .rules import Contribution
from .state import Stateful
from .utils import completion_text

logger = logging.get_logger(__name__)


def mass_shares(relevance: torch.Tensor, mask: torch.Tensor, mass: float = 0.8) -> torch.Tensor:
    """Per row of ``relevance`` (``[N, C]``, over the tokens where ``mask`` is 1): the share of its tokens that hold
    ``mass`` of its q mass (the smallest such set). 1/L means one token holds it all; ``mass`` means q is spread
    evenly; NaN for an all-zero (or empty) profile. All rows at once, with no host sync."""
    values = torch.where(mask.bool(), relevance.float(), 0.0)
    lengths = mask.bool().sum(-1)
    total = values.sum(-1)
    cumulative = values.sort(-1, descending=True).values.cumsum(-1)
    needed = torch.searchsorted(cumulative, (mass * total)[:, None]).squeeze(-1) + 1
    shares = torch.minimum(needed, lengths).double() / lengths.clamp(min=1)
    return torch.where((total > 0) & (lengths > 0), shares, torch.nan)


def process_means(gathered: list[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over the processes that logged it, from one dict per process (what ``gather_object``
    returns), so that every process logs the same values, as TRL logs its own metrics. A process can lack a key
    (a reward it replayed nothing of has no q statistics): the mean is then over the processes that have it."""
    keys = list(dict.fromkeys(key for metrics in gathered for key in metrics))
    return {
        key: sum(values) / len(values)
        for key in keys
        for values in [[metrics[key] for metrics in gathered if key in metrics]]
    }


def credit_metrics(
    credit: TokenCredit,
    relevance: torch.Tensor,
    replayed: torch.Tensor,
    with_q: torch.Tensor,
    mask: torch.Tensor,
    names: list[str],
    beta: float,
    betas: dict[str, float],
    seconds: tuple[float, float],
) -> dict[str, float]:
    """One generation batch's ``mrtpo/*`` metrics on this process (before the mean over processes): beta and each
    reward's (``betas``), the replayed share, the cap factor, the replay's time and its share of the step's
    (``seconds``: replay, total), and :func:`q_statistics` per reward."""
    q_means, concentration = q_statistics(relevance, with_q, mask, names)
    replay_seconds, total_seconds = seconds
    return {
        "mrtpo/beta": beta,
        **betas,
        "mrtpo/replayed_fraction": replayed.float().mean().item(),
        "mrtpo/cap_factor": credit.cap_factor,
        "mrtpo/replay_seconds": replay_seconds,
        "mrtpo/replay_share": replay_seconds / total_seconds if total_seconds > 0 else 0.0,
        **{f"mrtpo/q_mean/{name}": value for name, value in q_means.items()},
        **{f"mrtpo/q_mass80_token_share/{name}": value for name, value in concentration.items()},
    }


def q_statistics(
    relevance: torch.Tensor, with_q: torch.Tensor, mask: torch.Tensor, names: list[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Per reward, over the responses where its q was computed (``with_q`` ``[B, K]``): the mean q over their model
    tokens (where ``mask`` ``[B, C]`` is 1: the completion mask, times TRL's tool mask in tool rollouts;
    ``mrtpo/q_mean``), and the mean share of those tokens that hold 80% of each profile's q mass
    (``mrtpo/q_mass80_token_share``, all-zero profiles left out). Rewards with no such response are absent. One host
    sync for the whole batch, whatever its size and number of rewards."""
    tokens = mask.bool()[:, None, :] & with_q.bool()[:, :, None]  # [B, K, C]
    counts = tokens.sum((0, 2))
    sums = torch.where(tokens, relevance.float(), 0.0).sum((0, 2))
    shares = mass_shares(relevance.flatten(0, 1), tokens.flatten(0, 1)).view(with_q.shape)  # [B, K], NaN: no share
    read = ~shares.isnan()
    share_means = torch.where(read, shares, 0.0).sum(0) / read.sum(0).clamp(min=1)
    counts, means, share_means, shared = torch.stack(
        [counts.float(), sums / counts.clamp(min=1), share_means, read.sum(0).float()]
    ).tolist()
    means_out = {name: means[k] for k, name in enumerate(names) if counts[k] > 0}
    concentration = {name: share_means[k] for k, name in enumerate(names) if shared[k] > 0}
    return means_out, concentration


class CollapseMonitor(Stateful):
    """Counts, per reward, consecutive steps whose replayed q mass is near zero.

    Near-zero q everywhere means the weights fall back to uniform: the run is silently plain GDPO for that reward.
    :meth:`update` returns the rewards that have just reached ``patience`` such steps (each reported once per run of
    collapsed steps).
    """

    state_entries = ("streaks",)

    def __init__(self, patience: int, threshold: float = 1e-6):
        self.patience = patience  # 0: never warns
        self.threshold = threshold
        self.streaks: dict[str, int] = {}

    def update(self, mean_relevance: dict[str, float]) -> list[str]:
        if self.patience <= 0:
            return []
        alarms = []
        for name, value in mean_relevance.items():
            streak = self.streaks.get(name, 0) + 1 if value < self.threshold else 0
            self.streaks[name] = streak
            if streak == self.patience:
                alarms.append(name)
        return alarms

    def warnings(self, metrics: dict[str, float]) -> list[str]:
        """:meth:`update` with the ``mrtpo/q_mean/<reward>`` of a batch's logged ``metrics``, with what to tell the
        user about each reward that has just collapsed."""
        prefix = "mrtpo/q_mean/"
        mean_relevance = {key[len(prefix) :]: value for key, value in metrics.items() if key.startswith(prefix)}
        return [
            f"Reward '{name}': its replayed q has stayed below {self.threshold:g} for {self.patience} steps. Its info "
            "block no longer changes the policy's predictions, so its credit is uniform (plain GDPO). Check that the "
            "block carries the information its verifier uses."
            for name in self.update(mean_relevance)
        ]


@dataclass
class CreditRecord:
    """Everything credit assignment produced for one local generation batch (``B`` responses, ``K`` rewards)."""

    prompts: list
    completions: list[str]
    completion_ids: torch.Tensor  # [B, C]
    mask: torch.Tensor  # [B, C]
    rewards: torch.Tensor  # [B, K], NaN = None
    group_advantages: torch.Tensor  # [B, K] A_k
    relevance: torch.Tensor  # [B, K, C] q (0 where not replayed)
    replayed: torch.Tensor  # [B, K]
    weights: torch.Tensor  # [B, K, C] w
    advantages: torch.Tensor  # [B, C] final token advantages
    beta: float  # beta_n of step 9
    reward_betas: torch.Tensor  # [K] each reward's beta in step 5 (beta_n * g_k with per-reward strength)
    groups: torch.Tensor | None = None  # [B, K] information groups (None: each reward its own)
    info_blocks: list[list[str | None]] | None = None  # per response, each reward's info block text (None: not built)
    # each term's part of the final advantages by name ([B, C], after the rescale: what the loss sees of it) and where
    # its steps end (per response, token positions); the rewards' negative credit dropped there ([B, K, C] bool)
    contributions: dict[str, torch.Tensor] = field(default_factory=dict)
    steps: dict[str, list[list[int]]] = field(default_factory=dict)
    failure_suffix: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        batch: ScoredBatch,
        credit: TokenCredit,
        relevance,
        replayed,
        beta: float,
        betas: float | torch.Tensor,
        added: Contribution | None = None,
    ) -> CreditRecord:
        """The batch's record; ``added``: what the terms added (:class:`~trl_mrtpo.rules.Contribution`)."""
        num_rewards = batch.group_advantages.shape[1]
        reward_betas = betas if isinstance(betas, torch.Tensor) else torch.full((num_rewards,), float(betas))
        added = added or Contribution()
        mask = batch.mask.to(credit.advantages.dtype)
        return cls(
            prompts=batch.prompts,
            completions=[completion_text(c) for c in batch.completions],
            completion_ids=batch.output["completion_ids"],
            mask=batch.mask,
            rewards=batch.rewards,
            group_advantages=batch.group_advantages,
            relevance=relevance,
            replayed=replayed,
            weights=credit.weights,
            advantages=credit.advantages,
            beta=beta,
            reward_betas=reward_betas.float().cpu(),
            groups=batch.information_groups,
            info_blocks=None
            if batch.info_blocks is None
            else [[b and b.text for b in row] for row in batch.info_blocks],
            contributions={name: part.to(mask) * mask / credit.rescale for name, part in added.parts.items()},
            steps=dict(added.steps),
            failure_suffix=added.failure_suffix,
        )


def log_credit(
    trainer, mode: str, credit: TokenCredit, relevance, replayed, mask, beta: float, seconds: tuple
) -> None:
    """A generation batch's credit figures (:func:`credit_metrics`, the processes' means, one collective), the collapse
    monitor's warnings, the completions table's credit column, and the advantages TRL logged replaced by what the
    loss will see; ``seconds``: the replay's and the whole credit's."""
    # a rule that replays without reading q (a log-likelihood contrast, say) has no q statistics
    with_q = replayed if "relevance" in trainer.credit_rule.reads else torch.zeros_like(replayed)
    names, betas = trainer.reward_func_names, trainer.reward_strength.logged_betas(beta, trainer.reward_func_names)
    betas = {k: v for (k, v), b in zip(betas.items(), trainer.info_block_builders) if b is not None}  # never replayed
    local = credit_metrics(credit, relevance, replayed, with_q, mask, names, beta, betas, seconds)
    # one collective per generation batch, entered by every process: each logs the processes' mean
    metrics = process_means(gather_object([local]))
    for key, value in metrics.items():
        _trl.log_metric(trainer, mode, key, value)

    for warning in trainer._collapse_monitor.warnings(metrics) if mode == "train" else ():  # the same on every process
        logger.warning(warning)

    # A readable line per response in TRL's completions table (console, W&B, trackio): where credit went.
    # Decoding every token costs time each step, so only when that table is logged.
    if trainer.log_completions:
        from .observability.summaries import credit_summaries

        ids, names = trainer.last_credit.completion_ids, trainer.reward_func_names
        contributions = trainer.last_credit.contributions
        summaries = credit_summaries(
            trainer.processing_class, ids, mask, credit.advantages, relevance, with_q, names, contributions
        )
        _trl.log_completion_column(trainer, "mrtpo_credit", gather_object(summaries))

    # TRL logged the sequence-level advantages it computed; replace them with what the loss will see.
    per_response = (credit.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    _trl.replace_logged_advantages(trainer, trainer.accelerator.gather(per_response).tolist())


def first_step_line(trainer, responses: int) -> str | None:
    """The line printed before training's first generation (the progress bar only moves when a step ends, which on a
    CPU can take minutes); None where nothing is said: outside training, past step 0, or with progress bars off."""
    if not trainer.is_in_train or trainer.state.global_step > 0 or trainer.args.disable_tqdm:
        return None
    replay = ", replaying the info blocks" if trainer._replays and trainer._beta() > 0 else ""
    return (
        f"Step 1: sampling {responses} responses per process ({trainer.num_generations} per prompt), scoring "
        f"{len(trainer.reward_funcs)} rewards{replay}; the progress bar moves when the step ends."
    )
