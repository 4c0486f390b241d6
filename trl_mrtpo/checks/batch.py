"""Checks that run every generation batch, on what user code returned for it: each reward function's values (wrapped
where TRL calls it), the batch's rewards, and the info blocks and replay contexts (docs/method.md step 2): no
special token, no overlapping spans, nothing appended in the assistant's turn, no context past the positions."""

from __future__ import annotations

import copy
import functools
import inspect
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..info_blocks import InfoBlock, InfoBlockError, Prompt, find_span, information_groups
from .config import within_float32


def _reward_value(name: str, index: int, value: Any) -> float | None:
    """One reward value as a float (None stays None), or a TypeError/ValueError naming the reward and sample."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex():
            raise TypeError(
                f"reward function '{name}' returned a tensor of shape {tuple(value.shape)} and dtype {value.dtype} "
                f"for sample {index}; each reward must be one real number (or None where it does not apply)."
            )
        value = value.item()
    elif hasattr(value, "item") and hasattr(value, "dtype") and getattr(value, "shape", None) == ():  # numpy scalar
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, numbers.Real):
        raise TypeError(
            f"reward function '{name}' returned {type(value).__name__} {value!r:.60} for sample {index}; each reward "
            "must be a real number (int, float, bool, numpy scalar or 0-d tensor) or None where it does not apply."
        )
    if value == value and not within_float32(value):  # NaN passes: it means "does not apply"
        raise ValueError(
            f"reward function '{name}' returned {value!r:.40} for sample {index}; rewards must be finite and "
            "within float32's range (return None where a reward does not apply, and rescale scores beyond 3.4e38)."
        )
    return float(value)


def check_reward_values(name: str, values: Any, expected: int) -> list[float | None]:
    """What a reward function returned for ``expected`` completions, as floats (None: does not apply; NaN counts as
    None), or an error naming the function and the sample."""
    if (
        isinstance(values, (str, bytes, dict))
        or not isinstance(values, (Sequence, torch.Tensor))
        and not hasattr(values, "__array__")
    ):
        raise TypeError(
            f"reward function '{name}' returned a {type(values).__name__}; it must return a list with one reward per "
            f"completion ({expected} here)."
        )
    values = list(values)
    if len(values) != expected:
        raise ValueError(
            f"reward function '{name}' returned {len(values)} rewards for {expected} completions; it must return "
            "exactly one per completion."
        )
    return [_reward_value(name, i, v) for i, v in enumerate(values)]


def own_copies(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A user function's keyword arguments with its own copies of the prompts, completions and trajectories."""
    own = ("prompts", "completions", "trajectories")
    return {key: copy.deepcopy(value) if key in own else value for key, value in kwargs.items()}


def checked_reward(func: Callable, name: str) -> Callable:
    """``func`` with its return value checked by :func:`check_reward_values` (sync or async, name kept). It gets
    copies of the prompts and completions: a function that edits them changes nothing the next reward, the info
    blocks or the replay see. A first batch scored None throughout, or early batches giving one value, is warned about
    (:func:`_early_batches_check`)."""
    early_batches = _early_batches_check(name)
    # one value per completion (per environment, for an environment's reward called with ``environments`` alone)
    owed = lambda kwargs: len(kwargs.get("completions", kwargs.get("environments")))  # noqa: E731
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):

        @functools.wraps(func)
        async def checked_async(*args, **kwargs):
            values = await func(*args, **own_copies(kwargs))
            return early_batches(check_reward_values(name, values, owed(kwargs)))

        checked_async.__name__ = name  # TRL names a reward by it (a callable object's class name otherwise)
        checked_async.early_batches = early_batches.seen
        return checked_async

    @functools.wraps(func)
    def checked(*args, **kwargs):
        return early_batches(check_reward_values(name, func(*args, **own_copies(kwargs)), owed(kwargs)))

    checked.__name__ = name
    checked.early_batches = early_batches.seen
    return checked


def early_batches_of(func: Callable) -> dict | None:
    """What :func:`checked_reward`'s check has seen of ``func``'s early batches (None for a function it does not
    wrap): ``sample_credit`` puts it back."""
    return getattr(func, "early_batches", None)


# Generation batches after which a reward that gave every sample one value is warned about.
CONSTANT_REWARD_BATCHES = 10


def _early_batches_check(name: str) -> Callable[[list], list]:
    """Passes a reward's values through, warning once when the first batch is None (NaN) throughout (a forgotten
    ``return`` trains as a reward that never applies), and once when the first :data:`CONSTANT_REWARD_BATCHES`
    batches gave every sample one value (a wrong path or column scores everything alike: no advantage anywhere)."""
    seen = {"batches": 0, "values": set()}

    def check(values: list) -> list:
        seen["batches"] += 1
        if seen["batches"] == 1 and values and all(v is None or v != v for v in values):
            warnings.warn(
                f"The reward function '{name}' returned None for every sample of the first generation batch: "
                "those samples get no advantage from it. Ignore this if the reward does not apply to those "
                "samples (TRL's convention for None); otherwise check that it returns its scores.",
                UserWarning,
                stacklevel=2,
            )
        if seen["batches"] <= CONSTANT_REWARD_BATCHES:
            seen["values"].update(v for v in values if v is not None and v == v)
        if seen["batches"] == CONSTANT_REWARD_BATCHES and len(seen["values"]) == 1:
            (value,) = seen["values"]
            warnings.warn(
                f"The reward function '{name}' gave every sample the same value, {value:g}, over the first "
                f"{CONSTANT_REWARD_BATCHES} generation batches: a constant reward gives no advantage anywhere. Check "
                "what it reads (a database path, a dataset column); a strict reward that is right in none of a "
                "group's samples is normal, one that is the same for every sample of every group is not.",
                UserWarning,
                stacklevel=2,
            )
        return values

    check.seen = seen
    return check


def check_batch_rewards(rewards: torch.Tensor, names: Sequence[str], num_generations: int, warned: set) -> None:
    """``[N, K]`` rewards of a generation batch, in groups of ``num_generations``, with one host sync: each is finite
    or NaN ("does not apply"), since an infinity would silently turn its group's advantages to 0 (it stops the step
    naming the reward and the sample); a reward that is NaN for some samples of a group and scored for others is
    warned about once (its name joins ``warned``): those samples get advantage 0 from it, not a penalty."""
    nan = torch.isnan(rewards).view(-1, num_generations, rewards.shape[1])
    partly = nan.any(1) & ~nan.all(1)  # [groups, K]
    flags = torch.cat([torch.isinf(rewards), partly]).tolist()
    infinite = [(i, k) for i, row in enumerate(flags[: len(rewards)]) for k, bad in enumerate(row) if bad]
    if infinite:
        sample, k = infinite[0]
        raise ValueError(
            f"reward function '{names[k]}' returned {rewards[sample, k].item()} for sample {sample} of the "
            "generation batch; rewards must be finite (return None where a reward does not apply)."
        )
    for group, row in enumerate(flags[len(rewards) :]):
        for k in (k for k, bad in enumerate(row) if bad and names[k] not in warned):
            warned.add(names[k])
            warnings.warn(
                f"The reward function '{names[k]}' returned None for some samples of group {group} (prompt "
                f"{group} of the generation batch) and a score for the others: None means 'does not apply', so "
                "those samples get advantage 0 from it, not a penalty. Return 0.0 (or the reward's lowest score) "
                "for an answer it cannot parse, and None only where the reward does not apply to the prompt.",
                UserWarning,
                stacklevel=3,
            )


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


def context_format(processing_class) -> tuple[str | None, list[str]]:
    """What step 2's contexts are checked for (:func:`check_blocks`): the chat template's assistant header and the
    special tokens."""
    return assistant_header(processing_class), special_tokens(processing_class)


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
