"""Step-level rewards and failure boundaries: how a user hands them to :class:`~trl_mrtpo.MRTPOTrainer`, and how
character spans of a completion become token positions (docs/method.md, "Process rewards" and "Failure-suffix
masking").

A **process reward** is called like a TRL reward function, ``func(prompts=..., completions=...,
completion_ids=..., **dataset_columns, trainer_state=...)``, and returns one entry per completion: a list of
:class:`Step` (or ``(start, end, score)`` tuples), each step a character span ``[start, end)`` of the completion text
and its score, or None when it has no steps. In a tool rollout it is also given ``trajectories`` (one
:class:`~trl_mrtpo.trajectories.Trajectory` or None per completion) and scores turns: a tool rollout's steps are
``(turn, score)`` pairs, ``turn`` one of that trajectory's ``turns``, ending on the turn's last token.

A **failure boundary** builder is called like an info-block builder, ``builder(prompt=..., completion=..., row=...,
score=...)``, for each (response, reward) pair whose credit is negative, and returns the character offset where the
response's last unrecovered error ends (exclusive), or None.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch
from accelerate.utils import gather_object

from ..batch import ScoredBatch
from ..checks.batch import own_copies
from ..checks.config import within_float32
from ..checks.inputs import check_builders
from ..info_blocks import Prompt, call_builder, per_reward
from ..rules import Contribution, CreditSetup, CreditTerm, resolve_credit_rule
from ..trajectories import Trajectory, Turn
from ..utils import completion_text, function_name
from .credit import failure_suffix_mask, process_advantages

NO_BOUNDARY = -1


def reward_columns(rows: Sequence[dict]) -> dict[str, list]:
    """The dataset columns TRL hands a reward function as keyword arguments: one list per column, every column but
    the prompt and the completion fields (as ``GRPOTrainer._calculate_rewards`` builds them)."""
    keys = [key for key in rows[0] if key not in ("prompt", "completion", "completion_ids")] if rows else []
    return {key: [row[key] for row in rows] for key in keys}


class Step(NamedTuple):
    """One scored step of a completion: the characters ``text[start:end]`` and their score."""

    start: int
    end: int
    score: float


def step_spans(text: str, separator: str = "\n") -> list[tuple[int, int]]:
    """The ``[start, end)`` spans of ``text``'s steps, split at ``separator`` (which belongs to neither side); steps
    made only of whitespace are skipped."""
    if not separator:
        raise ValueError("step_spans needs a non-empty separator (an empty one splits nowhere and never ends).")
    spans, start = [], 0
    while start <= len(text):
        cut = text.find(separator, start)
        end = len(text) if cut < 0 else cut
        if text[start:end].strip():
            spans.append((start, end))
        if cut < 0:
            break
        start = cut + len(separator)
    return spans


def _common_prefix_length(a: str, b: str) -> int:
    length = min(len(a), len(b))
    for i in range(length):
        if a[i] != b[i]:
            return i
    return length


def text_alignment(tokenizer, completion_ids: Sequence[int], text: str, where: str) -> tuple[bool, str, int]:
    """How the text a reward scored relates to the completion's ids: ``(skip_special_tokens, decoded, start)``, the
    decode of the ids (without or with special tokens) in which ``text`` starts at character ``start``.

    ``text`` is that decode itself, or occurs in it exactly once (TRL's response parser moves reasoning or tool calls
    out of the message content, leaving the content as one piece of the decode). Anything else cannot be placed on
    tokens: a ValueError names ``where`` instead of guessing.
    """
    views = {skip: tokenizer.decode(list(completion_ids), skip_special_tokens=skip) for skip in (True, False)}
    for skip, decoded in views.items():
        if decoded == text:
            return skip, decoded, 0
    for skip, decoded in views.items():
        start = decoded.find(text)
        if start >= 0 and decoded.find(text, start + 1) < 0:
            return skip, decoded, start
    raise ValueError(
        f"The {where} scored the text {text!r:.80}, which is neither the decode of the completion's token ids "
        f"({views[False]!r:.120}) nor a piece that occurs exactly once in it, so its character offsets cannot be "
        "placed on tokens. Score the decoded completion_ids (passed to process rewards) instead of a rewritten text."
    )


def token_positions(
    tokenizer, completion_ids: Sequence[int], text: str, char_ends: Sequence[int], where: str = "step rule"
) -> list[int]:
    """For each exclusive character end ``e`` of ``text`` (the text a reward scored), the index of the completion
    token that holds character ``e - 1``, read from the decoded pieces of the ids themselves (docs/method.md,
    "Process rewards": spans to tokens).

    ``text`` is related to the ids by :func:`text_alignment` (refused, naming ``where``, when it is not recoverable
    from them). A step that ends inside a token ends at that token. Prefixes of the ids are decoded and compared
    with the full decode, so a token that holds only part of a multi-byte character (its prefix decodes to a
    replacement character) does not count as holding it: the character belongs to the token that completes it.
    Binary search: ``O(log T)`` decodes per end.
    """
    if not char_ends:
        return []
    skip, full, start = text_alignment(tokenizer, completion_ids, text, where)
    count = len(completion_ids)
    covered_cache: dict[int, int] = {}

    def covered(tokens: int) -> int:
        if tokens not in covered_cache:
            decoded = tokenizer.decode(list(completion_ids[:tokens]), skip_special_tokens=skip)
            covered_cache[tokens] = _common_prefix_length(decoded, full)
        return covered_cache[tokens]

    positions = []
    for end in char_ends:
        low, high = 1, count
        while low < high:
            middle = (low + high) // 2
            if covered(middle) >= start + end:
                high = middle
            else:
                low = middle + 1
        positions.append(max(low - 1, 0))
    return positions


def _is_score(value: Any) -> bool:
    """A finite number within float32's range, as rewards are (a group's statistics then stay finite in float64)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and within_float32(value)


def _checked_score(score: Any, index: int, where: str) -> float:
    if hasattr(score, "item") and math.prod(getattr(score, "shape", ())) == 1:  # several numbers: refused below
        score = score.item()
    if not _is_score(score):
        raise ValueError(
            f"Step {index} of the {where} has score {score!r:.40}; scores are finite numbers within float32's "
            "range (3.4e38)."
        )
    return float(score)


def _step_list(result: Any, where: str) -> list:
    if result is None:
        return []
    if not isinstance(result, (list, tuple)):
        raise TypeError(f"The {where} returned {type(result).__name__}; it must return a list of steps or None.")
    return list(result)


def checked_steps(result: Any, name: str, sample: int, text: str) -> list[Step]:
    """What a process reward returned for one completion, validated: a clear error naming the function and the
    sample for anything but in-range spans with finite scores; sorted by where the steps end."""
    where = f"process reward '{name}' on sample {sample}"
    steps = []
    for index, step in enumerate(_step_list(result, where)):
        if not isinstance(step, (list, tuple)) or len(step) != 3:
            raise TypeError(f"Step {index} of the {where} is {step!r:.80}; a step is (start, end, score).")
        start, end, score = step
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
            raise TypeError(f"Step {index} of the {where} has span ({start!r}, {end!r}); offsets are ints.")
        if not 0 <= start < end <= len(text):
            raise ValueError(
                f"Step {index} of the {where} spans [{start}, {end}), outside the completion's {len(text)} "
                "characters (or empty)."
            )
        steps.append(Step(start, end, _checked_score(score, index, where)))
    return sorted(steps, key=lambda s: s.end)


def checked_turn_steps(result: Any, name: str, sample: int, view: Trajectory) -> list[tuple[float, int]]:
    """What a process reward returned for one tool rollout (``view``), validated: ``(turn, score)`` pairs, each
    ``turn`` one of ``view.turns``, as ``(score, position of the turn's last token)`` sorted by position; a
    character span, a turn of another trajectory or a bad score is refused naming the function and the sample."""
    where = f"process reward '{name}' on sample {sample}"
    steps = []
    for index, step in enumerate(_step_list(result, where)):
        turn = step[0] if isinstance(step, (list, tuple)) and len(step) == 2 else None
        if not isinstance(turn, Turn) or turn not in view.turns:  # compared only as a Turn: arrays never reach ==
            raise ValueError(
                f"Step {index} of the {where} is {step!r:.80}; in a tool rollout a step is (turn, score) with turn "
                "one of trajectories[i].turns: a character span does not address the tokens of a multi-turn "
                "completion."
            )
        steps.append((_checked_score(step[1], index, where), max(turn.tokens[1] - 1, 0)))
    return sorted(steps, key=lambda s: s[1])


def check_process_rewards(funcs: Sequence[Callable] | Callable | None) -> list[Callable]:
    """The trainer's ``process_rewards`` argument as a list of callables."""
    if funcs is None:
        return []
    if not isinstance(funcs, (list, tuple)):
        funcs = [funcs]
    for func in funcs:
        if not callable(func):
            raise TypeError(f"process_rewards entries must be callables, got {type(func).__name__}.")
    return list(funcs)


def process_reward_weights(weights: Sequence[float] | None, count: int) -> list[float]:
    """``process_reward_weights`` checked against the ``count`` process rewards (all 1.0 when None)."""
    if weights is None:
        return [1.0] * count
    if len(weights) != count:
        raise ValueError(
            f"process_reward_weights has {len(weights)} entries but there are {count} process rewards; pass one "
            "weight per process reward, in the same order."
        )
    return list(weights)


def check_step_rules(
    process_rewards: Sequence[Callable],
    failure_builders: Sequence[Callable | None],
    keeps_trl_advantages: bool,
) -> list[str]:
    """The step-level credit rules in use (named for later checks), refused under plain GRPO, which has no per-reward
    token credit for them to act on."""
    rules = [
        name
        for name, on in (("process_rewards", bool(process_rewards)), ("failure_boundaries", any(failure_builders)))
        if on
    ]
    if rules and keeps_trl_advantages:
        raise ValueError(
            f"{' and '.join(rules)} act on MRTPO's per-reward token credit; credit_assignment='grpo' is plain "
            "GRPOTrainer. Use 'gdpo' for uniform credit with them."
        )
    return rules


def failure_boundary(
    builder: Callable[..., Any],
    reward_name: str,
    sample: int,
    prompt: Prompt,
    completion: str,
    row: dict[str, Any],
    score: float,
    trajectory: Trajectory | None = None,
) -> int | Turn | None:
    """Call one failure-boundary builder for one failing pair and validate its answer: None, an int offset in
    ``[1, len(completion)]``, or, in a tool rollout (``trajectory`` given), one of ``trajectory.turns``: the turn
    whose last token ends the error."""
    where = f"failure boundary builder of reward '{reward_name}' on sample {sample}"
    offset = call_builder(builder, where, ValueError, prompt, completion, row, score, trajectory)
    if offset is None:
        return None
    if trajectory is not None:
        if not isinstance(offset, Turn) or offset not in trajectory.turns:
            raise ValueError(
                f"The {where} returned {type(offset).__name__} {offset!s:.60}; in a tool rollout it must return one "
                "of trajectory.turns (the turn where the error ends) or None: a character offset does not address the "
                "tokens of a multi-turn completion."
            )
        return offset
    if not isinstance(offset, int) or isinstance(offset, bool):
        raise TypeError(f"The {where} returned {type(offset).__name__}; it must return a character offset or None.")
    if not 1 <= offset <= len(completion):
        raise ValueError(
            f"The {where} returned offset {offset}, outside the completion's {len(completion)} characters."
        )
    return offset


def process_credit(
    funcs: Sequence[Callable],
    names: Sequence[str],
    weights: Sequence[float],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    mask: torch.Tensor,
    tokenizer,
    num_generations: int,
    rank: int,
    trainer_state: Any = None,
    views: Sequence[Trajectory | None] | None = None,
) -> tuple[torch.Tensor, list[tuple[str, float]]]:
    """``[B, C]`` float64 the weighted sum of the process rewards' token advantages of this process's ``B``
    responses (docs/method.md, "Process rewards"), ``(name, mean step score)`` per scored response for the logs, and
    by name each process reward's weighted ``[B, C]`` part and its steps' last tokens per response (inspection).

    Each function scores the steps of every completion (character spans, checked by :func:`checked_steps`); step
    ends land on tokens by :func:`token_positions`. In a batch of tool rollouts (``views`` given: each response's
    :class:`~trl_mrtpo.trajectories.Trajectory` or None) the functions also get ``trajectories`` and a rollout's
    steps are turns (:func:`checked_turn_steps`), each ending on its turn's last token. Step scores are gathered
    over processes: a group's normalisation (:func:`~trl_mrtpo.credit.process_advantages`) sees all its responses.
    """
    texts = [completion_text(c) for c in completions]
    tool_batch = {} if views is None else {"trajectories": list(views)}
    views = views or [None] * len(texts)
    total = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    means, parts, step_ends = [], {}, {}
    for func, name, weight in zip(funcs, names, weights):
        results = func(
            **own_copies(dict(prompts=prompts, completions=completions, **tool_batch)),
            completion_ids=completion_ids,
            trainer_state=trainer_state,
            **columns,
        )
        if not isinstance(results, (list, tuple)) or len(results) != len(texts):
            raise ValueError(
                f"process reward '{name}' must return one list of steps (or None) per completion: "
                f"{len(texts)} expected, got {len(results) if isinstance(results, (list, tuple)) else results!r}."
            )
        local = []
        for i, (result, text, view) in enumerate(zip(results, texts, views)):
            sample = rank * len(texts) + i
            if view is not None:
                turn_steps = checked_turn_steps(result, name, sample, view)
                local.append(([score for score, _ in turn_steps], [end for _, end in turn_steps]))
                continue
            steps = checked_steps(result, name, sample, text)
            where = f"process reward '{name}' on sample {sample}"
            ends = token_positions(tokenizer, completion_ids[i], text, [step.end for step in steps], where)
            local.append(([step.score for step in steps], ends))
        gathered = gather_object(local)
        width = max(1, max(len(scores) for scores, _ in gathered))
        scores = torch.full((len(gathered), width), float("nan"), dtype=torch.float64)
        ends = torch.zeros((len(gathered), width), dtype=torch.long)
        for j, (values, positions) in enumerate(gathered):
            scores[j, : len(values)] = torch.tensor(values, dtype=torch.float64)
            ends[j, : len(positions)] = torch.tensor(positions, dtype=torch.long)
            if values:
                means.append((name, sum(values) / len(values)))
        advantages = process_advantages(scores, ends, num_generations, mask.shape[1])
        parts[name] = weight * advantages[rank * len(texts) : (rank + 1) * len(texts)].to(mask.device)
        step_ends[name] = [positions for _, positions in local]
        total += parts[name]
    return total, means, parts, step_ends


def failure_suffix(
    builders: Sequence[Callable | None],
    reward_names: Sequence[str],
    credit: torch.Tensor,
    rewards: torch.Tensor,
    prompts: list,
    completions: list,
    rows: list[dict],
    completion_ids: list[list[int]],
    tokenizer,
    num_positions: int,
    views: Sequence[Trajectory | None] | None = None,
) -> torch.Tensor:
    """``[B, K, C]`` bool, the positions after each failing pair's error boundary (docs/method.md, "Failure-suffix
    masking"). Only pairs with negative ``credit`` (``[B, K]``, ``c_k A_k``) ask their builder; a boundary lands on
    its token by :func:`token_positions`, one pass per response, or, in a tool rollout (``views``: each response's
    :class:`~trl_mrtpo.trajectories.Trajectory` or None), on the last token of the turn the builder returned."""
    boundaries = torch.full(credit.shape, NO_BOUNDARY, dtype=torch.long)
    views = views or [None] * len(completions)
    failing, scores = (credit < 0).tolist(), rewards.tolist()  # two host syncs per batch, not one per pair
    for i, completion in enumerate(completions):
        text = completion_text(completion)
        offsets = {}  # reward -> where its error ends
        for k, (builder, name) in enumerate(zip(builders, reward_names)):
            if builder is not None and failing[i][k]:
                offset = failure_boundary(builder, name, i, prompts[i], text, rows[i], scores[i][k], views[i])
                if isinstance(offset, Turn):
                    boundaries[i, k] = max(offset.tokens[1] - 1, 0)
                elif offset is not None:
                    offsets[k] = offset
        names = ", ".join(f"'{reward_names[k]}'" for k in offsets)
        where = f"failure boundary builder of {names} on sample {i}"
        positions = token_positions(tokenizer, completion_ids[i], text, list(offsets.values()), where)
        for k, position in zip(offsets, positions):
            boundaries[i, k] = position
    return failure_suffix_mask(boundaries, num_positions)


@dataclass
class StepCredit(CreditTerm):
    """A run's step-level credit term: its process rewards (with their names and weights) and each reward's failure
    boundary builder (or None); built from the trainer's ``process_rewards`` and ``failure_boundaries``."""

    name: ClassVar[str] = "process"
    process_rewards: list[Callable]
    process_weights: list[float]
    failure_builders: list[Callable | None]
    reward_names: list[str]
    token_credit: list[str] = field(default_factory=list)

    @property
    def functions(self) -> list[Callable]:
        return self.process_rewards

    @classmethod
    def build(cls, setup: CreditSetup) -> StepCredit:
        """Checks the trainer's arguments (refused under a rule that keeps TRL's advantages) and names the rules in
        use for the start-up checks."""
        process_rewards = check_process_rewards(setup.options.get("process_rewards"))
        weights = process_reward_weights(setup.args.process_reward_weights, len(process_rewards))
        builders = setup.options.get("failure_boundaries")
        check_builders(builders, setup.reward_names, "failure_boundaries")
        builders = per_reward(builders, len(setup.reward_names))
        keeps_trl = (setup.rule or resolve_credit_rule(setup.args)).keeps_trl_advantages
        rules = check_step_rules(process_rewards, builders, keeps_trl)
        return cls(process_rewards, weights, builders, setup.reward_names, rules)

    def card_lines(self, code: Callable[[str], str]) -> list[str]:
        """The process rewards (with their weights) and the failure boundaries (per reward) the run used."""
        lines = []
        if self.process_rewards:
            weighted = zip(self.process_rewards, self.process_weights)
            listed = ", ".join(f"{code(function_name(f))} (weight {w:g})" for f, w in weighted)
            lines.append(f"process rewards (step credit, added after the cap): {listed}")
        boundaries = zip(self.reward_names, self.failure_builders)
        if named := [f"{code(name)}: {code(function_name(b))}" for name, b in boundaries if b is not None]:
            lines.append(f"failure boundaries: {', '.join(named)}")
        return lines

    def __call__(
        self, batch: ScoredBatch, tokenizer, num_generations: int, rank: int, trainer_state: Any = None
    ) -> Contribution:
        """The local batch's ``process`` (``[B, C]``, :func:`process_credit`) and ``failure_suffix`` (``[B, K, C]``,
        :func:`failure_suffix`) for :func:`~trl_mrtpo.credit.weighted_token_advantages` (None where a rule is not in
        use), and each process reward's mean step score per scored response, logged as
        ``mrtpo/term/process/<name>``."""
        completion_ids = batch.completion_ids
        process, means, parts, steps = None, [], {}, {}
        if self.process_rewards:
            process, means, parts, steps = process_credit(
                self.process_rewards,
                [function_name(func) for func in self.process_rewards],
                self.process_weights,
                batch.prompts,
                batch.completions,
                completion_ids,
                reward_columns(batch.inputs),
                batch.mask,
                tokenizer,
                num_generations,
                rank,
                trainer_state=trainer_state,
                views=batch.views if "tool_mask" in batch.output else None,
            )
        suffix = None
        if any(self.failure_builders):
            credit = batch.group_advantages * batch.reward_weights.to(batch.group_advantages)
            suffix = failure_suffix(
                self.failure_builders,
                self.reward_names,
                credit,
                batch.rewards,
                batch.prompts,
                batch.completions,
                batch.inputs,
                completion_ids,
                tokenizer,
                batch.mask.shape[1],
                batch.views,
            ).to(batch.mask.device)
        named = {f"process reward '{name}'": part for name, part in parts.items()}
        return Contribution(process, suffix, means, named, {f"process reward '{n}'": e for n, e in steps.items()})
