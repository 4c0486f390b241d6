"""The info blocks' checks (docs/method.md step 2): each builder, before the model loads; each batch's blocks (no
special token, no overlapping spans, nothing appended in the assistant's turn, no context past the positions)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ..info_blocks import (
    InfoBlock,
    InfoBlockError,
    Prompt,
    SpanNotFound,
    accepts_trajectory,
    build_block,
    find_span,
    information_groups,
)
from ..utils import function_name


def _span_location(prompt: Prompt, text: str) -> tuple[int, int, int]:
    """``(message, start, end)`` of a span the prompt holds (:func:`build_block` checked it; message 0 in a string)."""
    (message,) = find_span(prompt, text) or (0,)
    content = prompt if isinstance(prompt, str) else prompt[message]["content"]
    start = content.index(text)
    return message, start, start + len(text)


def check_spans(prompt: Prompt, blocks: Sequence[InfoBlock | None], reward_names: Sequence[str], sample: int) -> None:
    """Two in-prompt spans of one sample must not overlap or nest: removing one would cut into the other. Spans of one
    information group carry the same text and are removed as one."""
    spans = [
        (name, group, _span_location(prompt, b.text))
        for name, b, group in zip(reward_names, blocks, information_groups(blocks))
        if b is not None and b.placement == "in_prompt"
    ]
    for i, (name, group, (message, start, end)) in enumerate(spans):
        for other, other_group, (other_message, other_start, other_end) in spans[i + 1 :]:
            if group != other_group and message == other_message and start < other_end and other_start < end:
                raise InfoBlockError(
                    f"The in_prompt blocks of rewards '{name}' and '{other}' on sample {sample} overlap in the prompt "
                    f"(characters {start}-{end} and {other_start}-{other_end} of message {message}); each reward's "
                    "span must be a separate part of the prompt."
                )


def check_builders(
    builders: Sequence[Callable[..., Any] | None] | Callable | None,
    reward_names: Sequence[str],
    argument: str = "info_blocks",
) -> list:
    """Validate a per-reward builder argument of the trainer (``info_blocks``, ``failure_boundaries``): one builder
    (or None) per reward function."""
    if builders is None:
        return [None] * len(reward_names)
    if not isinstance(builders, (list, tuple)):
        builders = [builders]
    if len(builders) != len(reward_names):
        raise ValueError(
            f"{argument} has {len(builders)} entries but there are {len(reward_names)} reward functions "
            f"({', '.join(reward_names)}); pass one builder or None per reward, in the same order."
        )
    for builder, name in zip(builders, reward_names):
        if builder is not None and not callable(builder):
            raise TypeError(
                f"{argument} entry for reward '{name}' is a {type(builder).__name__}, not a callable or None."
            )
    return list(builders)


BUILDER_SIGNATURE = "(*, prompt, completion, row, score)"


def check_builders_on_first_row(
    builders: Any, reward_names: Sequence[str], dataset: Any, tools: bool, environments: bool = False
) -> None:
    """Before the model loads: each builder bound to ``BUILDER_SIGNATURE`` and called once on the dataset's first row
    with an empty completion (and trajectory view where tools are used). A signature that does not bind, a
    ``KeyError`` on the row or a return value :func:`build_block` refuses is refused here; any other exception is a
    warning (it may only fail on the empty stand-in). Rows without a ``prompt`` (an environment's) are not checked.
    With ``environments``, an in-prompt span is looked for in the prompts TRL builds, at the first batch: an
    environment's ``reset()`` may add it.
    """
    columns = getattr(dataset, "column_names", None)
    if not isinstance(builders, (list, tuple)) or columns is None or "prompt" not in columns:
        return
    if not hasattr(dataset, "__len__") or not len(dataset):
        return
    row = dict(dataset[0])
    view = None
    if tools:
        from ..trajectories import Trajectory

        view = Trajectory(turns=(), results=())
    for builder, name in zip(builders, reward_names):
        if builder is None or not callable(builder):  # refused by check_builders
            continue
        label = f"info block builder {function_name(builder)!r} of reward {name!r}"
        extra = {"trajectory": view} if accepts_trajectory(builder) else {}
        try:
            inspect.signature(builder).bind(prompt=None, completion="", row=row, score=0.0, **extra)
        except TypeError as mismatch:
            raise TypeError(
                f"The {label} cannot be called as training calls it ({mismatch}): a builder takes "
                f"{BUILDER_SIGNATURE}, by keyword (plus `trajectory` in tool rollouts), and returns a str, an "
                "InfoBlock or None."
            ) from None
        except ValueError:  # a callable without a signature to read: its call below tells
            pass
        try:
            build_block(builder, name, 0, row["prompt"], "", row, 0.0, view)
        except SpanNotFound:
            if not environments:
                raise
        except InfoBlockError as refused:
            cause = refused.__cause__
            checked = "(checked on the train dataset's first row, with an empty completion, before the model loads)"
            if cause is None:
                raise InfoBlockError(f"{refused} {checked}") from None
            if isinstance(cause, KeyError):
                raise InfoBlockError(
                    f"{refused}: the row has no such field {checked}; the dataset's columns: {', '.join(columns)}."
                ) from cause
            warnings.warn(
                f"The {label} raised {type(cause).__name__} ({cause}) on the train dataset's first row with an empty "
                "stand-in completion. If it only fails on an empty completion, ignore this; otherwise training stops "
                "at the first step with this error.",
                UserWarning,
                stacklevel=3,
            )


def special_tokens(processing_class) -> list[str]:
    """The tokenizer's special tokens (an info block holding one is refused)."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    return [token for token in getattr(tokenizer, "all_special_tokens", []) if token]


def assistant_header(processing_class) -> str | None:
    """What the chat template adds for ``add_generation_prompt`` (e.g. ``<|im_start|>assistant``), or None."""
    if not getattr(processing_class, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "x"}]
    try:
        closed = processing_class.apply_chat_template(messages, tokenize=False)
        opened = processing_class.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # a template that cannot render a bare user turn: nothing to compare with
        return None
    header = opened[len(closed) :].strip() if opened.startswith(closed) else ""
    return header or None


def check_blocks(
    prompts: Sequence[Prompt],
    blocks: Sequence[Sequence[InfoBlock | None]],
    names: Sequence[str],
    header: str | None,
    special_tokens: Sequence[str],
) -> None:
    """Refuse blocks that would forge a chat turn (a special token of the template), in-prompt spans of one sample
    that overlap or nest (removing one would cut into the other), and appended blocks after a string prompt that
    already holds the assistant ``header`` (they would land in the assistant's turn, not the user's)."""
    for i, sample_blocks in enumerate(blocks):
        for name, block in zip(names, sample_blocks):
            found = next((t for t in special_tokens if block is not None and t in block.text), None)
            if found is not None:
                raise InfoBlockError(
                    f"The info block of reward '{name}' on sample {i} contains the special token {found!r}: in "
                    "the replay context it would forge a turn or an end of text. Info blocks must be plain text."
                )
            string_turn = isinstance(prompts[i], str) and header is not None and header in prompts[i]
            if string_turn and block is not None and block.placement == "appended":
                raise InfoBlockError(
                    f"The info block builder of reward '{name}' on sample {i} returned an appended block, but "
                    f"the sample's prompt is a string that already contains the chat template's assistant "
                    f"header {header!r}: the block would be appended after it, in the assistant's turn. Pass "
                    "conversational prompts (a list of messages), or make the block in_prompt."
                )
        check_spans(prompts[i], sample_blocks, names, i)


def check_context_length(
    context_ids: Sequence[Sequence[Sequence[int]]],
    completion_ids: Sequence[Sequence[int]],
    blocks: Sequence[Sequence[InfoBlock | None]],
    prompt_lengths: Sequence[int],
    names: Sequence[str],
    limit: int | None,
) -> None:
    """Info blocks that carry a replay context past the model's ``limit`` positions (where its prompt and
    completion fit) would give meaningless q and slow replays: refused, naming the sample and the longest block."""
    if not limit:
        return
    for i, (contexts, completion) in enumerate(zip(context_ids, completion_ids)):
        if not contexts or prompt_lengths[i] + len(completion) > limit:
            continue  # nothing replayed, or already beyond the positions without any block: not the blocks' doing
        if len(contexts[0]) + len(completion) > limit:
            lengths = {name: len(b.text) for name, b in zip(names, blocks[i]) if b is not None}
            longest = max(lengths, key=lengths.get)
            raise InfoBlockError(
                f"Sample {i}: its info blocks make the replay context {len(contexts[0])} tokens (the prompt alone "
                f"is {prompt_lengths[i]}), plus {len(completion)} completion tokens, beyond the model's {limit} "
                f"positions. The longest block is reward '{longest}''s ({lengths[longest]} characters): shorten it."
            )
