"""A structured view of a tool rollout for info-block builders: the model's turns, each with its tool calls, their
arguments, results and errors, and the token range of every turn and tool result (docs/method.md, "Tool
rollouts"). Built from what TRL's tool loop leaves: the completion's messages and its ``tool_mask``. And the checks of
what environments, tools and rollout functions bring (loaded only by the runs that have them)."""

from __future__ import annotations

import ast
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class FrozenDict(dict):
    """A read-only, hashable dict: what a view's tool-call arguments are, so that one builder cannot change what the
    next sees and views can be dict keys. ``json.dumps`` writes it as the dict it is."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("a trajectory view is read-only: copy its arguments (dict(call.arguments)) to change them")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _read_only

    def __hash__(self) -> int:
        return hash(frozenset(self.items()))

    def __copy__(self) -> FrozenDict:
        return self

    def __deepcopy__(self, memo: dict) -> FrozenDict:
        return self

    def __reduce__(self):
        return FrozenDict, (dict(self),)


def frozen(value: Any) -> Any:
    """``value`` made immutable all the way down: dicts as :class:`FrozenDict`, lists and tuples as tuples (JSON
    writes them as lists)."""
    if isinstance(value, Mapping):
        return FrozenDict({key: frozen(item) for key, item in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(frozen(item) for item in value)
    return value


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: ``result`` is what the tool returned as TRL put it in the conversation, None when the
    call was never run (the rollout reached the length limit or ``max_tool_calling_iterations`` first); ``error`` is
    the message when the call failed (TRL records ``{"error": ...}`` as its result), else None. ``arguments`` are
    read-only all the way down (:func:`frozen`): views are shared by every builder, and hashable."""

    name: str
    arguments: Mapping[str, Any]
    result: str | None
    error: str | None


@dataclass(frozen=True)
class Turn:
    """One model turn: its text, the calls it made, and ``tokens``, the ``[start, end)`` range of its tokens in the
    completion ids (empty in a rollout that takes no part in the loss: truncated, with ``mask_truncated_completions``,
    TRL zeroes its masks)."""

    text: str
    calls: tuple[ToolCall, ...]
    tokens: tuple[int, int]


@dataclass(frozen=True)
class Trajectory:
    """The model's turns in order, and the token ranges of the tool results between them."""

    turns: tuple[Turn, ...]
    results: tuple[tuple[int, int], ...]

    @property
    def calls(self) -> list[ToolCall]:
        return [call for turn in self.turns for call in turn.calls]

    @property
    def failed(self) -> list[ToolCall]:
        return [call for call in self.calls if call.error is not None]


def tool_error(content: Any) -> str | None:
    """The error of a tool message's content, parsed defensively (the tool's own text is never evaluated as code)."""
    if not isinstance(content, str) or not content.startswith("{'error'"):
        return None
    try:
        value = ast.literal_eval(content)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return str(value["error"]) if isinstance(value, dict) and set(value) == {"error"} else None


def _runs(mask: Sequence[int]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The ``[start, end)`` runs of 1 (the model's tokens) and of 0 (tool results) in ``mask``."""
    ones, zeros, start = [], [], 0
    for t in range(1, len(mask) + 1):
        if t == len(mask) or mask[t] != mask[start]:
            (ones if mask[start] else zeros).append((start, t))
            start = t
    return ones, zeros


def message_calls(message: dict) -> list[dict]:
    """The calls of one assistant message as ``{"name", "arguments"}`` (TRL's parsed ``tool_calls``, read
    defensively: arguments that are not a dict count as none; a read-only copy, so no builder can edit them)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", call) if isinstance(call, dict) else None
        if isinstance(function, dict):
            arguments = function.get("arguments")
            calls.append(
                {
                    "name": str(function.get("name")),
                    "arguments": frozen(arguments) if isinstance(arguments, dict) else FrozenDict(),
                }
            )
    return calls


def trajectory(messages: Any, tool_mask: Sequence[int]) -> Trajectory | None:
    """The structured view of one completion (TRL's list of messages) over its ``tool_mask`` (unpadded), or None for a
    completion that is not a tool rollout (a string, or neither a tool message nor a call). Calls that never ran
    (``max_tool_calling_iterations`` reached, or the rollout ended first) are in the view with ``result=None``."""
    if not isinstance(messages, list):
        return None
    model_runs, result_runs = _runs(list(tool_mask))
    turns, pending, tool_messages = [], [], 0
    for message in messages:
        if not isinstance(message, dict):
            continue
        if message.get("role") == "assistant":
            pending = message_calls(message)
            span = model_runs[len(turns)] if len(turns) < len(model_runs) else (len(tool_mask), len(tool_mask))
            turns.append({"text": str(message.get("content") or ""), "calls": [], "tokens": span, "pending": pending})
        elif message.get("role") == "tool":
            tool_messages += 1
            if turns and turns[-1]["pending"]:
                call = turns[-1]["pending"].pop(0)
                content = message.get("content")
                turns[-1]["calls"].append(ToolCall(call["name"], call["arguments"], str(content), tool_error(content)))
    for turn in turns:  # calls left without a result were never run
        turn["calls"] += [ToolCall(call["name"], call["arguments"], None, None) for call in turn["pending"]]
    if not tool_messages and not any(turn["calls"] for turn in turns):
        return None
    return Trajectory(
        turns=tuple(Turn(t["text"], tuple(t["calls"]), t["tokens"]) for t in turns), results=tuple(result_runs)
    )


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


def tool_views(output: dict, completions: Sequence[Any]) -> list[Trajectory | None]:
    """The structured view of each completion of a generation batch (TRL's output), or Nones when the batch has no
    tool rollouts (no ``tool_mask``)."""
    if "tool_mask" not in output:
        return [None] * len(completions)
    lengths = output["completion_mask"].sum(-1).tolist()
    masks = output["tool_mask"].tolist()
    return [trajectory(c, m[:n]) for c, m, n in zip(completions, masks, lengths)]


def agent_card_lines(trainer) -> list[str]:
    """What a tool-calling run's card names: its environments, the tools the model was offered, and the chat template
    (by the name TRL ships it under, when it is one of TRL's)."""
    factories = getattr(trainer, "environment_factories", None) or {}
    tools = trainer.tools
    lines = []
    if factories:
        names = sorted({getattr(factory, "__name__", type(factory).__name__) for factory in factories.values()})
        lines.append(f"environment (TRL's `environment_factory`): {', '.join(f'`{n}`' for n in names)}")
    lines.append("tools: " + ", ".join(f"`{getattr(tool, '__name__', tool)}`" for tool in tools))
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    from .chat_templates import shipped_template_name

    named = shipped_template_name(getattr(tokenizer, "chat_template", None))
    lines.append(f"chat template: {named or 'the tokenizer’s own, saved with the model'}")
    return lines


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
    from ._trl import RESET_APPEND_ERROR

    appended = RESET_APPEND_ERROR.search(str(error))
    if appended is None and "string indices must be integers" in str(error):  # TRL read a list of str as parts
        appended = (None, "a list of strings")
    if appended is None or environments is None:
        return None
    classes = sorted({type(environment).__name__ for environment in environments or ()}) or ["the environment"]
    return _reset_refusal(" or ".join(classes), appended[1], multimodal)
