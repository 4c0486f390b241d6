"""The checks of what environments, tools and rollout functions bring, each refusal naming the class or function
(loaded only by the runs that have them)."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def check_tool_results(completions: Sequence[Any], multimodal: bool = False) -> None:
    """Refuse a tool result a text model would not read: any list. TRL passes a list through as multimodal content
    parts, which a text model's chat template renders as an empty tool response (an empty list, records, even
    well-formed ``{"type": "text", ...}`` parts), so the model would read nothing where its result should be and its
    view would disagree with the tokens. A vision-language model (``multimodal``) may take content parts."""
    for i, completion in enumerate(completions):
        for message in completion if isinstance(completion, list) else []:
            if not isinstance(message, dict) or message.get("role") != "tool":
                continue
            content = message.get("content")
            if not isinstance(content, list):
                continue
            if multimodal and content and all(isinstance(part, dict) and "type" in part for part in content):
                continue
            parts = " (a vision-language model takes a list of content parts)" if multimodal else ""
            raise ValueError(
                f"Tool '{message.get('name')}' returned the list {content!r:.80} on sample {i}: TRL passes a list "
                "through as content parts, which a text model's chat template renders as an empty tool response: "
                f"the model would read nothing{parts}. Return a string (TRL converts other values with str)."
            )


def _rows(value: Any) -> list | None:
    """A list, tuple, array or tensor as a Python list along its first axis (TRL reads each of them); None for
    anything else."""
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) >= 1:
        return value.tolist()
    if isinstance(value, Sequence) and not isinstance(value, str):
        return list(value)
    return None


def checked_rollout(rollout_func: Callable) -> Callable:
    """``rollout_func`` whose output is checked where it returns: a dict (TRL's contract) with one completion per
    prompt it was given, and an ``env_mask`` (when there is one) of one row of 0/1 per completion, as long as its
    ids. TRL pads the mask with 1 and multiplies it into the loss mask, so a mask of the wrong length would silently
    shift which tokens count as the model's: the credit would land on what the environment wrote. Completion ids and
    mask rows may be lists, arrays or tensors, as TRL reads them."""
    where = f"rollout_func {getattr(rollout_func, '__name__', type(rollout_func).__name__)!r}"

    @functools.wraps(rollout_func)
    def checked(prompts, trainer):
        output = rollout_func(prompts, trainer)
        if not isinstance(output, Mapping):
            raise TypeError(
                f"{where} returned {type(output).__name__}; it must return a dict with 'prompt_ids', "
                "'completion_ids' and 'logprobs' (and optionally 'env_mask' and columns for the rewards)."
            )
        completions = _rows(output.get("completion_ids"))
        if completions is None:
            return output  # TRL names the missing key
        if len(completions) != len(prompts):
            raise ValueError(
                f"{where} returned {len(completions)} completions for the {len(prompts)} prompts it was given; it "
                "must return one per prompt (TRL passes each prompt once per generation)."
            )
        env_mask = output.get("env_mask")
        if env_mask is None:
            return output
        masks = _rows(env_mask)
        if masks is None or len(masks) != len(completions):
            count = len(masks) if masks is not None else type(env_mask).__name__
            raise ValueError(f"{where} returned env_mask with {count} rows for {len(completions)} completions.")
        for i, (mask, ids) in enumerate(zip(masks, completions)):
            values = _rows(mask)
            if (
                values is None
                or len(values) != len(ids)
                or any(v not in (0, 1) or isinstance(v, float) for v in values)
            ):
                found = f"{len(values)} entries" if values is not None else type(mask).__name__
                raise ValueError(
                    f"{where} returned an env_mask for completion {i} that is not a list of 0/1 as long as its "
                    f"{len(ids)} completion ids (found {found}: {str(values)[:60]}); 1 marks the "
                    "model's tokens, 0 what the environment wrote."
                )
        return output

    return checked


def check_environment_arguments(kwargs: dict[str, Any]) -> None:
    """``environment_factory`` and ``tools`` as TRL uses them, checked before TRL builds anything from them: a factory
    (or a dict of factories) TRL calls once per rollout, and tools that are functions (their signature and docstring
    become the schema the model reads)."""
    factories = kwargs.get("environment_factory")
    if factories is not None:
        named = factories.items() if isinstance(factories, Mapping) else [(None, factories)]
        for name, factory in named:
            if not callable(factory):
                where = "environment_factory" if name is None else f"environment_factory[{name!r}]"
                raise TypeError(
                    f"{where} is an instance of {type(factory).__name__}; pass the class (or a function returning a "
                    "new environment): TRL builds one environment per rollout and resets it for each prompt."
                )
            declared = inspect.getattr_static(factory, "get_reward", None) if isinstance(factory, type) else None
            if declared is not None and not inspect.isfunction(declared):  # TRL takes a plain method, else none
                raise TypeError(
                    f"{factory.__name__}.get_reward is a {type(declared).__name__}; TRL reads an environment's reward "
                    "from a get_reward method (def get_reward(self) -> float) and ignores anything else, so this "
                    "environment's reward would be dropped."
                )
            looks_like_reward = [m for m in ("reward", "compute_reward", "get_score") if hasattr(factory, m)]
            if isinstance(factory, type) and looks_like_reward and not hasattr(factory, "get_reward"):
                warnings.warn(
                    f"{factory.__name__} has a method {looks_like_reward[0]!r} but no get_reward: TRL reads an "
                    f"environment's reward from get_reward only, and offers {looks_like_reward[0]!r} to the model as "
                    "a tool. Rename it get_reward if it is the reward.",
                    UserWarning,
                    stacklevel=3,
                )
    for index, tool in enumerate(kwargs.get("tools") or ()):
        if not callable(tool):
            raise TypeError(
                f"tools[{index}] is {type(tool).__name__} {tool!r:.40}; a tool is a function (its signature and "
                "docstring become the schema the model reads), not its name."
            )


def _reset_refusal(environment: str, returned: str, multimodal: bool) -> str:
    """The refusal of what ``environment``'s ``reset()`` returned (``returned``: its type, and its value if known)."""
    return (
        f"{environment}.reset() returned {returned}; it returns None or the text appended to the prompt's last message"
        + (" (or content parts)." if multimodal else " (content parts only for a vision-language model).")
    )


def check_observations(rows: Sequence[dict], prompts: Sequence[Any], environments: Sequence[Any]) -> None:
    """For a text model, what environments' ``reset()`` returned, read from the prompts TRL built: content parts (a
    list its template renders as nothing, the info blocks after them too) are refused naming the environment."""
    for row, prompt, environment in zip(rows, prompts, environments):
        own = row.get("prompt")
        given_parts = isinstance(own, list) and bool(own) and isinstance(own[-1].get("content"), list)
        if isinstance(prompt, list) and prompt and isinstance(prompt[-1].get("content"), list) and not given_parts:
            parts = prompt[-1]["content"][1:]
            raise TypeError(_reset_refusal(type(environment).__name__, f"list {parts!r:.60}", multimodal=False))


def reset_refusal(error: TypeError, environments: Sequence[Any] | None, multimodal: bool) -> str | None:
    """When TRL could not append what an environment's ``reset()`` returned to the prompt's text (``str + dict``):
    the message naming the environment's class (from TRL's batch of environments; None: the run has none) and the
    returned type (from Python's own error text, :data:`~trl_mrtpo._trl.RESET_APPEND_ERROR`); else None."""
    from .._trl import RESET_APPEND_ERROR

    appended = RESET_APPEND_ERROR.search(str(error))
    if appended is None and "string indices must be integers" in str(error):  # TRL read a list of str as parts
        appended = (None, "a list of strings")
    if appended is None or environments is None:
        return None
    classes = sorted({type(environment).__name__ for environment in environments or ()}) or ["the environment"]
    return _reset_refusal(" or ".join(classes), appended[1], multimodal)
