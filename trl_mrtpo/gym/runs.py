"""Runs on the credit gym: RL with :class:`~trl_mrtpo.MRTPOTrainer` per method, and q localisation measured
against the ground-truth relevant positions."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..credit import relevance_specificity
from ..info_blocks import build_contexts
from ..relevance import Relevance, ReplayRecord
from ..replay import replay_relevance
from .task import (
    KINDS,
    GymSpec,
    all_constraints_met,
    chat_prompt_ids,
    constraint_blocks,
    constraint_failure_boundaries,
    constraint_rewards,
    gym_example,
    oracle_process_reward,
    prompt_text,
    relevant_positions,
    response_words,
    row_constraints,
    supervised_policy,
)

# a gym run logs only what it records itself: no trackers, checkpoints, plots, progress bars or warnings
QUIET_RUN = {
    "report_to": "none",
    "save_strategy": "no",
    "logging_steps": 10_000,
    "disable_tqdm": True,
    "collapse_warning_steps": 0,
}
SEPARATOR = " "  # between the prompt and an appended note (the gym's tokenizer splits on whitespace)


def gym_dataset(spec: GymSpec, num_prompts: int, seed: int):
    """``num_prompts`` prompts drawn from ``seed`` (identical for every method run with that seed)."""
    from datasets import Dataset

    rng = random.Random(f"prompts-{seed}")
    return Dataset.from_list([gym_example(rng, spec) for _ in range(num_prompts)])


@dataclass(frozen=True)
class RunSettings:
    """What one RL run of the gym uses besides the task and its seed.

    ``method`` is a credit mode, ``"oracle"`` (MRTPO's steps 5-8 with q set to the ground-truth relevant positions
    instead of the replay's: the upper bound of what any relevance profile can give) or ``"opsd"`` (TRL's
    self-distillation, the constraint sentences restated as the live teacher's privileged context,
    :mod:`trl_mrtpo.baselines.opsd`). ``options`` are further ``ResearchConfig`` fields as ``(name, value)`` pairs
    (the credit options under test). ``process`` adds a process reward: ``"oracle"``
    (:func:`~trl_mrtpo.gym.task.oracle_process_reward`) or ``"shepherd"`` (Math-Shepherd soft labels from the
    policy, ``shepherd_rollouts`` continuations per step). ``failure_masking`` drops each failing constraint's
    penalty after its last relevant position."""

    method: str = "mrtpo"
    steps: int = 150
    prompts_per_step: int = 8
    num_generations: int = 8
    learning_rate: float = 1e-4
    credit_beta: float = 0.5
    credit_warmup_steps: int = 10
    max_second_moment_ratio: float = 2.0
    reward_weighting: str = "static"
    options: tuple[tuple[str, Any], ...] = ()
    process: str = ""
    shepherd_rollouts: int = 4
    failure_masking: bool = False

    def identity(self) -> dict:
        """The fields that define the run (the later fields only when set, so earlier runs keep their keys)."""
        fields = asdict(self)
        for name, default in LATER_FIELDS.items():
            if fields[name] == default:
                del fields[name]
        if not self.process:
            del fields["shepherd_rollouts"]
        return fields


LATER_FIELDS = {"options": (), "process": "", "failure_masking": False}


def oracle_relevance(completions: Sequence[str], rows: Sequence[dict], num_positions: int) -> torch.Tensor:
    """``[B, K, C]`` the oracle's q: 1 on the positions whose word, changed alone, flips reward k (for a failing
    pair, the positions that would make it pass), 0 elsewhere. The gym's tokenizer is word-level, so word t is
    completion token t."""
    constraints = [row_constraints(row["constraints"]) for row in rows]
    relevance = torch.zeros(len(completions), len(constraints[0]) if constraints else 0, num_positions)
    for i, (text, owned) in enumerate(zip(completions, constraints)):
        words = response_words(text)
        for k, constraint in enumerate(owned):
            positions = [t for t in relevant_positions(constraint, words) if t < num_positions]
            relevance[i, k, positions] = 1.0
    return relevance


def oracle_provider(policy: Any, record: ReplayRecord) -> Relevance:
    """A relevance provider that never runs the policy: the oracle's q (:func:`oracle_relevance`) on every pair whose
    reward varies within its group."""
    mask = record.mask
    relevance = oracle_relevance(record.completions, record.rows, mask.shape[1]).to(mask.device)
    return Relevance(relevance, record.varying.clone(), True)


def _process_rewards(spec: GymSpec, settings: RunSettings) -> list:
    if settings.process == "oracle":
        return [oracle_process_reward(spec.length)]
    if settings.process == "shepherd":
        from ..steps.step_labels import MathShepherd

        # one word per step; a continuation runs to the response's full length (its end token included)
        return [MathShepherd(all_constraints_met, settings.shepherd_rollouts, step_separator=" ", batch_size=256)]
    if settings.process:
        raise ValueError(f"unknown gym process reward {settings.process!r}; use 'oracle' or 'shepherd'")
    return []


def _gym_trainer_class():
    from ..research import ResearchTrainer

    class GymTrainer(ResearchTrainer):
        """Records every generation's rewards with the constraints they were scored against."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scored_batches: list[tuple[torch.Tensor, list]] = []

        def record_rewards(self, inputs, rewards):
            self.scored_batches.append((rewards.detach().cpu().clone(), [row["constraints"] for row in inputs]))

    return GymTrainer


def _gym_opsd_class():
    from ..baselines.opsd import opsd_trainer_class

    class GymOPSDTrainer(opsd_trainer_class()):
        """OPSD on the gym (the constraint sentences restated as the teacher's privileged context), recording every
        rollout's rewards with the constraints they were scored against, as :class:`GymTrainer` does."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.scored_batches: list[tuple[torch.Tensor, list]] = []

        def score_rollouts(self, inputs, batch):
            table = super().score_rollouts(inputs, batch)
            if self.model.training:
                self.scored_batches.append((table.clone(), [row["constraints"] for row in inputs]))
            return table

    return GymOPSDTrainer


def step_record(rewards: torch.Tensor, constraints: Sequence[Sequence[Sequence[str]]]) -> dict[str, float]:
    """One step's mean reward overall, per slot and per constraint kind (NaN for a kind the batch lacks)."""
    record = {"mean_reward": rewards.mean().item()}
    for k in range(rewards.shape[1]):
        record[f"constraint_{k}"] = rewards[:, k].mean().item()
    for kind in KINDS:
        values = [rewards[i, k].item() for i, row in enumerate(constraints) for k, c in enumerate(row) if c[0] == kind]
        record[f"kind/{kind}"] = sum(values) / len(values) if values else float("nan")
    return record


def train_run(
    spec: GymSpec,
    settings: RunSettings,
    seed: int,
    cache_dir: str | Path,
    output_dir: str | Path,
    device: str = "cpu",
) -> list[dict]:
    """One RL run of ``MRTPOTrainer`` on the gym from the seed's supervised policy; one record per step.

    The seed fixes the supervised policy, the prompts and their order, and the sampling seed, so every method
    starts from the same policy and sees the same prompts.
    """
    from transformers import set_seed

    from ..research import ResearchConfig
    from ..research.config import arm_settings

    model, tokenizer = supervised_policy(spec, seed, cache_dir, device=device)
    config = ResearchConfig(
        output_dir=str(output_dir),
        credit_assignment={"oracle": "mrtpo", "opsd": "gdpo"}.get(settings.method, settings.method),
        credit_beta=settings.credit_beta,
        credit_warmup_steps=settings.credit_warmup_steps,
        max_second_moment_ratio=settings.max_second_moment_ratio,
        reward_weighting=settings.reward_weighting,
        max_steps=settings.steps,
        per_device_train_batch_size=settings.prompts_per_step * settings.num_generations,
        num_generations=settings.num_generations,
        max_completion_length=spec.length + 1,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="constant",
        seed=seed,
        use_cpu=device == "cpu",
        bf16=False,
        **QUIET_RUN,
        replay_batch_size=64,
        replay_min_shared_prefix=4,
        info_block_separator=SEPARATOR,
        **arm_settings(settings.options),
    )
    set_seed(seed)
    dataset = gym_dataset(spec, settings.steps * settings.prompts_per_step, seed)
    rewards, blocks = constraint_rewards(spec.num_constraints), constraint_blocks(spec.num_constraints, spec.placement)
    boundaries = constraint_failure_boundaries(spec.num_constraints) if settings.failure_masking else None
    if settings.method == "opsd":
        from ..baselines.opsd import opsd_config

        # the gym's vocabulary is smaller than SDFT's default top-100 logits: distil over all of it
        args = opsd_config(config, distillation_mode="full_logits")
        trainer = _gym_opsd_class()(
            model, rewards, blocks, args, dataset, processing_class=tokenizer, separator=SEPARATOR
        )
    else:
        trainer = _gym_trainer_class()(
            model=model,
            reward_funcs=rewards,
            info_blocks=blocks,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            relevance_provider=oracle_provider if settings.method == "oracle" else None,
            process_rewards=_process_rewards(spec, settings),
            failure_boundaries=boundaries,
        )
    trainer.train()
    return [
        {"step": step, **step_record(rewards, constraints)}
        for step, (rewards, constraints) in enumerate(trainer.scored_batches)
    ]


@torch.no_grad()
def satisfaction(
    spec: GymSpec,
    seed: int,
    cache_dir: str | Path,
    num_prompts: int = 32,
    num_generations: int = 4,
    device: str = "cpu",
) -> list[dict]:
    """How often the supervised policy meets each constraint when it is stated, and when it is removed from the
    prompt (the policy conditions on its constraints when the second is lower). One record per constraint."""
    model, tokenizer = supervised_policy(spec, seed, cache_dir, device=device)
    torch.manual_seed(seed)
    records = []
    for row in gym_dataset(spec, num_prompts, seed + 2_000_000).to_list():
        constraints = row_constraints(row["constraints"])
        for k, constraint in enumerate(constraints):
            rates = {}
            for label, kept in (("stated", constraints), ("removed", constraints[:k] + constraints[k + 1 :])):
                words = sample_words(model, tokenizer, prompt_text(kept), spec.length, num_generations, device)
                rates[label] = sum(constraint.satisfied(w) for w in words) / num_generations
            records.append({"seed": seed, "kind": constraint.kind, **rates})
    return records


def _sample(model, tokenizer, messages: list[dict], length: int, count: int, device: str) -> list[list[int]]:
    """``count`` answers to a conversation, as token ids up to and including the end token."""
    prompt_ids = chat_prompt_ids(tokenizer, messages)
    sampled = model.generate(
        torch.tensor([prompt_ids] * count, device=device),
        attention_mask=torch.ones(count, len(prompt_ids), dtype=torch.long, device=device),
        do_sample=True,
        max_new_tokens=length + 1,
        pad_token_id=tokenizer.pad_token_id,
        top_k=0,
        top_p=1.0,
    )[:, len(prompt_ids) :].tolist()
    eos = tokenizer.eos_token_id
    return [ids[: ids.index(eos) + 1] if eos in ids else ids for ids in sampled]


def sample_words(model, tokenizer, content: str, length: int, count: int, device: str) -> list[list[str]]:
    """``count`` responses of the gym policy to the user message ``content``, as word lists."""
    messages = [{"role": "user", "content": content}]
    sampled = _sample(model, tokenizer, messages, length, count, device)
    return [response_words(tokenizer.decode(ids, skip_special_tokens=False)) for ids in sampled]


def mass_ratio(profile: torch.Tensor, positions: Sequence[int]) -> float:
    """Share of a q profile's mass on ``positions`` divided by their share of the tokens (1: no localisation);
    NaN for a profile without mass."""
    total = profile.sum().item()
    if total <= 0:
        return float("nan")
    return (profile[list(positions)].sum().item() / total) / (len(positions) / profile.numel())


@torch.no_grad()
def localisation(
    spec: GymSpec,
    seed: int,
    cache_dir: str | Path,
    num_prompts: int = 32,
    num_generations: int = 4,
    device: str = "cpu",
) -> list[dict]:
    """Where the supervised policy's q lands, against the ground truth, on its own sampled responses.

    For every response and constraint k whose relevant positions are a proper subset of the response: the mass
    ratio of q_k on them (``ratio``) and, as a control, the mass ratio on the same positions of q_j for the next
    constraint j of the prompt, which the reward of k does not depend on (``control``); and ``1 - cos`` between q_k
    and the other constraints' mean profile (``specificity``, what the per-reward strength reads).
    """
    model, tokenizer = supervised_policy(spec, seed, cache_dir, device=device)
    blocks = constraint_blocks(spec.num_constraints, spec.placement)
    rows = gym_dataset(spec, num_prompts, seed + 1_000_000).to_list()  # prompts no run trains on
    torch.manual_seed(seed)
    contexts, completions, owners = [], [], []
    for row in rows:
        constraints = row_constraints(row["constraints"])
        sampled = _sample(model, tokenizer, row["prompt"], spec.length, num_generations, device)
        info = [block(row=row) for block in blocks]
        p_all, removed = build_contexts(row["prompt"], info, [[k] for k in range(len(info))], SEPARATOR)
        context_ids = [chat_prompt_ids(tokenizer, p) for p in (p_all, *removed)]
        for ids in sampled:
            contexts.append(context_ids)
            completions.append(ids)
            owners.append(constraints)
    q = replay_relevance(model, contexts, completions, temperature=1.0, batch_size=64, min_shared_prefix=4)
    records = []
    for profiles, ids, constraints in zip(q, completions, owners):
        words = response_words(tokenizer.decode(ids, skip_special_tokens=False))
        specificity = relevance_specificity(profiles[None], torch.ones(1, len(constraints), dtype=torch.bool))
        for k, constraint in enumerate(constraints):
            positions = relevant_positions(constraint, words)
            if not 0 < len(positions) < len(ids):
                continue
            records.append(
                {
                    "seed": seed,
                    "kind": constraint.kind,
                    "satisfied": int(constraint.satisfied(words)),
                    "relevant_share": len(positions) / len(ids),
                    "ratio": mass_ratio(profiles[k], positions),
                    "control": mass_ratio(profiles[(k + 1) % len(constraints)], positions),
                    "specificity": specificity[k].item(),
                }
            )
    return records
