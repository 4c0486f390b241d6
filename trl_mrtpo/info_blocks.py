"""Info blocks: the text each reward's verifier decides with, and where it sits (docs/method.md step 2).

A reward may own an *info block builder*, a callable invoked once per sample as::

    builder(prompt=..., completion=..., row=..., score=...) -> str | InfoBlock | None

with ``prompt`` the sample's prompt (a string, or a list of chat messages), ``completion`` the completion text,
``row`` the dataset row (a dict) and ``score`` the reward's value for that completion (float, NaN when the reward
returned None). It returns the block text or None (no block; the reward keeps uniform credit). A plain string is
an *appended* block; return ``InfoBlock(text, placement="in_prompt")`` for a span the policy already saw.

- *appended*: ``P_all`` is the prompt with every non-empty appended block added to the last user message, in reward
  order, separated by ``separator``; ``P_not_k`` is ``P_all`` without block k. Sampling used the bare prompt.
- *in_prompt*: the text is a span of the prompt; ``P_not_k`` is ``P_all`` with that span removed.
"""

from __future__ import annotations

import copy
import inspect
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

Prompt = str | list[dict[str, Any]]
PLACEMENTS = ("appended", "in_prompt")


@dataclass(frozen=True)
class InfoBlock:
    """One reward's info block for one sample."""

    text: str
    placement: Literal["appended", "in_prompt"] = "appended"

    def __post_init__(self):
        if not isinstance(self.text, str):
            raise TypeError(f"InfoBlock.text must be a string, got {type(self.text).__name__}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"InfoBlock.placement must be one of {PLACEMENTS}, got {self.placement!r}")


class InfoBlockError(ValueError):
    """An info block builder failed or returned something unusable; the message names the reward and sample."""


class SpanNotFound(InfoBlockError):
    """An in-prompt block whose text the prompt does not hold."""


def _prompt_preview(prompt: Prompt) -> str:
    text = prompt if isinstance(prompt, str) else str(prompt[-1].get("content", "")) if prompt else ""
    return repr(text[:80] + ("..." if len(text) > 80 else ""))


def accepts_trajectory(builder: Callable[..., Any]) -> bool:
    """Whether a builder takes ``trajectory`` (by that name, or through ``**kwargs``)."""
    try:
        parameters = inspect.signature(builder).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: given the four fields only
        return False
    return any(p.name == "trajectory" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


def call_builder(
    builder: Callable[..., Any],
    where: str,
    error: type[Exception],
    prompt: Prompt,
    completion: str,
    row: dict[str, Any],
    score: float,
    trajectory: Any = None,
) -> Any:
    """Call a per-sample builder (an info block's, a failure boundary's) with copies of the prompt and the row, so
    that a builder that edits what it is given cannot change the sample for the next builder or the replay; an
    exception it raises becomes ``error``, naming ``where``. A builder that takes ``trajectory`` also gets the tool
    rollout's structured view (:class:`~trl_mrtpo.trajectories.Trajectory`, None for a plain completion)."""
    extra = {"trajectory": trajectory} if accepts_trajectory(builder) else {}
    try:
        return builder(
            prompt=copy.deepcopy(prompt), completion=completion, row=copy.deepcopy(row), score=score, **extra
        )
    except Exception as raised:
        raise error(f"The {where} raised {type(raised).__name__}: {raised}") from raised


def build_block(
    builder: Callable[..., Any],
    reward_name: str,
    sample_index: int,
    prompt: Prompt,
    completion: str,
    row: dict[str, Any],
    score: float,
    trajectory: Any = None,
    warned_empty: set[str] | None = None,
) -> InfoBlock | None:
    """Call one builder for one sample and validate what it returns. Empty text counts as no block, warned about
    once per reward when ``warned_empty`` collects the rewards told (``None`` is the way to say "no block"; an empty
    string is what a builder returns for a row whose reference is missing)."""
    where = f"info block builder of reward '{reward_name}' on sample {sample_index} (prompt {_prompt_preview(prompt)})"
    result = call_builder(builder, where, InfoBlockError, prompt, completion, row, score, trajectory)
    if result is None:
        return None
    if isinstance(result, str):
        result = InfoBlock(result)
    if not isinstance(result, InfoBlock):
        raise InfoBlockError(
            f"The {where} returned {type(result).__name__}; it must return a str, an InfoBlock or None."
        )
    if not result.text.strip():
        if warned_empty is not None and reward_name not in warned_empty:
            warned_empty.add(reward_name)
            warnings.warn(
                f"The {where} returned an empty block: that sample keeps uniform credit for reward {reward_name!r}. "
                "Return None where a reward has no block; an empty string often means a row lacks the reference "
                "the block is built from (warned once per reward).",
                UserWarning,
                stacklevel=4,
            )
        return None
    if result.placement == "in_prompt":
        count = _span_count(prompt, result.text)
        if count == 0:
            raise SpanNotFound(
                f"The {where} returned an in_prompt block whose text {result.text[:60]!r} is not a span of the prompt."
            )
        if count > 1:
            raise InfoBlockError(
                f"The {where} returned an in_prompt block whose text {result.text[:60]!r} occurs {count} times in the "
                "prompt; it must occur once, so that removing it is unambiguous (include more of its sentence)."
            )
    return result


def _span_count(prompt: Prompt, text: str) -> int:
    """How often ``text`` occurs in the prompt (over every message with string content)."""
    if isinstance(prompt, str):
        return _occurrences(prompt, text)
    return sum(_occurrences(m.get("content"), text) for m in prompt if isinstance(m.get("content"), str))


def _occurrences(content: str, text: str) -> int:
    """How often ``text`` occurs in ``content``, overlapping occurrences included (``str.count`` skips them: "aba"
    is once in "ababa" for it, twice here, and removing either would be a guess)."""
    count, start = 0, content.find(text)
    while start >= 0:
        count, start = count + 1, content.find(text, start + 1)
    return count


def find_span(prompt: Prompt, text: str) -> tuple[int, ...] | None:
    """Where ``text`` occurs: ``()`` for a string prompt, ``(i,)`` for message i (last user message first)."""
    if isinstance(prompt, str):
        return () if text in prompt else None
    order = sorted(range(len(prompt)), key=lambda i: (prompt[i].get("role") != "user", -i))
    for i in order:
        content = prompt[i].get("content")
        if isinstance(content, str) and text in content:
            return (i,)
    return None


def _remove_span(prompt: Prompt, text: str) -> Prompt:
    location = find_span(prompt, text)
    if location is None:  # validated by build_block; kept as a guard for direct callers
        raise ValueError(f"{text[:60]!r} is not a span of the prompt")
    if isinstance(prompt, str):
        return _cut(prompt, text)
    out = copy.deepcopy(prompt)
    out[location[0]]["content"] = _cut(out[location[0]]["content"], text)
    return out


def _cut(content: str, text: str) -> str:
    """``content`` without the first occurrence of ``text``, leaving one separator where two would meet: the
    longer of the whitespace runs on either side ("A. B. C." without "B." reads "A. C.")."""
    start = content.index(text)
    left, right = content[:start], content[start + len(text) :]
    if not left.strip():
        return right.lstrip()
    if not right.strip():
        return left.rstrip()
    gap_left, gap_right = left[len(left.rstrip()) :], right[: len(right) - len(right.lstrip())]
    return left.rstrip() + max(gap_left, gap_right, key=len) + right.lstrip()


def _append(prompt: Prompt, texts: Sequence[str], separator: str) -> Prompt:
    if not texts:
        return prompt
    suffix = separator + separator.join(texts)
    if isinstance(prompt, str):
        return prompt + suffix
    out = copy.deepcopy(prompt)
    user_turns = [i for i, message in enumerate(out) if message.get("role") == "user"]
    target = user_turns[-1] if user_turns else len(out) - 1
    content = out[target]["content"]
    if isinstance(content, list):
        out[target]["content"] = content + [{"type": "text", "text": suffix}]
    else:
        out[target]["content"] = content + suffix
    return out


def build_contexts(
    prompt: Prompt, blocks: Sequence[InfoBlock | None], removals: Sequence[Sequence[int]], separator: str = "\n\n"
) -> tuple[Prompt, list[Prompt]]:
    """Build ``P_all`` and one context per entry of ``removals`` (step 2).

    Args:
        prompt: the sampling prompt ``P0``.
        blocks: one entry per reward (None = no block).
        removals: each entry lists the rewards whose blocks that context drops: ``[k]`` gives ``P_not_k``; the
            ``joint`` ablation drops all of them at once.
        separator: text between the prompt and each appended block.

    Returns:
        ``(P_all, [P_without_removal_0, ...])``.
    """

    groups = information_groups(blocks)
    carried = group_blocks(blocks, groups)

    def assemble(dropped: set[int]) -> Prompt:
        # spans first, from the prompt where each was found once; appended text cannot be mistaken for them
        out = prompt
        dropped = {groups[k] for k in dropped}  # removing one member's information removes its group's
        for g in sorted(dropped):
            if carried[g] is not None and carried[g].placement == "in_prompt":
                out = _remove_span(out, carried[g].text)
        kept = [b for g, b in enumerate(carried) if b is not None and g not in dropped]
        return _append(out, [b.text for b in kept if b.placement == "appended"], separator)

    return assemble(set()), [assemble(set(removal)) for removal in removals]


def canonical(text: str) -> str:
    """Text as it is compared, never as it is read: Unicode NFC, so that canonically equal forms (a composed and a
    decomposed accent), which a normalising tokenizer makes the same tokens, are one text."""
    return unicodedata.normalize("NFC", text)


def _canonical_prompt(prompt: Prompt) -> Prompt:
    if isinstance(prompt, str):
        return canonical(prompt)
    return [{**m, "content": canonical(m["content"])} if isinstance(m.get("content"), str) else m for m in prompt]


def information_groups(blocks: Sequence[InfoBlock | None]) -> list[int]:
    """Step 2's information groups of one sample: per reward, the first reward whose block carries the same text
    (compared stripped of whitespace at its ends, in NFC: :func:`canonical`); a reward without a block is its own."""
    first: dict[str, int] = {}
    return [
        k if block is None else first.setdefault(canonical(block.text.strip()), k) for k, block in enumerate(blocks)
    ]


def group_blocks(blocks: Sequence[InfoBlock | None], groups: Sequence[int]) -> list[InfoBlock | None]:
    """The block each information group carries once, at its first member's index (None elsewhere): a member's
    in-prompt span when there is one (the text is already in the prompt, and removal cuts it), else the first
    member's block."""
    carried: list[InfoBlock | None] = [None] * len(blocks)
    for k, block in enumerate(blocks):
        g = groups[k]
        if block is not None and (carried[g] is None or block.placement == "in_prompt"):
            carried[g] = block
    return carried


def removed_groups(wanted: Sequence[int], groups: Sequence[int]) -> list[int]:
    """The information groups a sample's replay removes, one context each, in the order of their first wanted
    member: a group is replayed once however many of its members qualify."""
    return list(dict.fromkeys(groups[k] for k in wanted))


def per_reward(builders: Any, count: int) -> list:
    """A per-reward builder argument (``info_blocks``, ``failure_boundaries``) as a list: None is no builder for any
    of the ``count`` rewards, one builder alone is a list of one (its length is checked where it is given)."""
    if builders is None:
        return [None] * count
    return list(builders) if isinstance(builders, (list, tuple)) else [builders]


def for_environment_rewards(builders: Any, functions: int, rewards: int) -> Any:
    """A per-reward builder list given for the ``functions`` reward functions only, extended with None for the rewards
    TRL adds after them (``rewards`` in all) from environments that own their reward (``get_reward``): those get no
    block (uniform credit) unless the list names one for them too."""
    if isinstance(builders, (list, tuple)) and len(builders) == functions < rewards:
        return [*builders, *[None] * (rewards - functions)]
    return builders


def build_blocks(
    builders: Sequence[Callable | None], names: Sequence[str], batch: Any, scores: list, warned_empty: set[str]
) -> list[list]:
    """Step 2's blocks for a batch (:class:`~trl_mrtpo.batch.ScoredBatch`, its rewards as ``scores``): per sample,
    each reward's :func:`build_block` (None for a reward without a builder; ``warned_empty``: the rewards whose
    empty block was warned about)."""
    from .utils import completion_text

    prompts, rows, views = batch.prompts, batch.inputs, batch.views
    completions = [completion_text(c) for c in batch.completions]
    return [
        [
            build_block(builder, name, i, prompts[i], completions[i], rows[i], scores[i][k], views[i], warned_empty)
            if builder is not None
            else None
            for k, (builder, name) in enumerate(zip(builders, names))
        ]
        for i in range(len(prompts))
    ]


def replay_contexts(
    blocks: list[list[InfoBlock | None]],
    names: Sequence[str],
    batch: Any,
    scores: list[list[float]],
    *,
    joint: bool,
    only_varying: bool,
    resting: set[int],
    separator: str,
) -> ReplayContexts:
    """Step 2's contexts for a batch (:class:`~trl_mrtpo.batch.ScoredBatch`, its rewards as ``scores``) and its
    checked ``blocks`` (:func:`build_blocks`): the rewards whose pair is replayed and the contexts.

    A pair is replayed when its reward has a block, applies to the sample (a NaN reward does not), varies within its
    group (or ``only_varying`` is off) and is not ``resting``, and the sample has tokens in the loss (a truncated
    completion masked by ``mask_truncated_completions`` has none, so its q could weigh nothing). The contexts hold
    one removal per information group with a wanted member (:func:`removed_groups`), or one of every block when
    ``joint``.
    """
    varies = batch.varying.tolist()  # one host sync for the batch, not one per pair
    in_loss = batch.mask.any(-1).tolist()
    resting = set() if joint else resting
    wanted = [
        [
            k
            for k in range(len(names))
            # a reward that is None for this sample gives it no advantage: nothing to place
            if in_loss[i]
            and blocks[i][k] is not None
            and scores[i][k] == scores[i][k]
            and (varies[i][k] or not only_varying)
            and k not in resting
        ]
        for i in range(len(blocks))
    ]
    groups = [information_groups(sample_blocks) for sample_blocks in blocks]
    contexts, leaks = [], {}
    for i, sample_wanted in enumerate(wanted):
        if not sample_wanted:  # only samples with a replayed pair get contexts (and are tokenized)
            contexts.append([])
            continue
        dropped = removed_groups(sample_wanted, groups[i])
        removals = [[k for k, b in enumerate(blocks[i]) if b is not None]] if joint else [[g] for g in dropped]
        full, removed = build_contexts(batch.prompts[i], blocks[i], removals, separator)
        contexts.append([full, *removed])
        if not joint:
            leaks.update(leaked_information(removed, dropped, blocks[i], groups[i], names))
    return ReplayContexts(wanted, groups, contexts, leaks)


class ReplayContexts(NamedTuple):
    """Step 2's output for a batch (:func:`replay_contexts`)."""

    wanted: list[list[int]]  # per sample, the rewards whose pair is replayed
    groups: list[list[int]]  # per sample, each reward's information group (:func:`information_groups`)
    contexts: list[list[Prompt]]  # per sample, [P_all, P_removed...] (empty when nothing is replayed)
    leaks: dict[str, str]  # reward -> where its information survives its removal (:func:`leaked_information`)


def leaked_information(
    removed: Sequence[Prompt],
    groups_removed: Sequence[int],
    blocks: Sequence[InfoBlock | None],
    groups: Sequence[int],
    names: Sequence[str],
) -> dict[str, str]:
    """Rewards whose block text still occurs in their ``P_not_k`` (one sample's ``removed`` contexts, one per group
    of ``groups_removed``): their q cannot measure the information, since the context still holds it. Per such
    reward, what holds the text: another reward's block that contains it, or the prompt. Texts are compared in NFC
    (:func:`canonical`)."""
    carried = group_blocks(blocks, groups)
    leaks = {}
    for context, g in zip(removed, groups_removed):
        text = canonical(carried[g].text.strip())
        if not _span_count(_canonical_prompt(context), text):
            continue
        holder = next(
            (
                f"the info block of reward {names[h]!r}"
                for h, other in enumerate(carried)
                if h != g and other is not None and text in canonical(other.text)
            ),
            "the prompt",
        )
        leaks.update({names[k]: holder for k in range(len(blocks)) if blocks[k] is not None and groups[k] == g})
    return leaks


def warn_leaks(leaks: dict[str, str], warned: dict[str, str]) -> None:
    """Once per reward (``warned``: reward -> what holds its text, updated): its block's text survives its removal,
    so its q cannot measure that information."""
    for name, holder in leaks.items():
        if name not in warned:
            warnings.warn(
                f"Reward {name!r}: its info block's text is still in the context that removes it, inside "
                f"{holder}, so its q cannot measure that information (a block contained in another, or repeating "
                "prompt text). Give rewards that judge with the same information the same block text: they "
                "then share it as one information group (docs/kits.md).",
                UserWarning,
                stacklevel=4,
            )
        warned[name] = holder
