"""A structured view of a tool rollout for info-block builders: the model's turns, each with its tool calls, their
arguments, results and errors, and the token range of every turn and tool result (docs/method.md, "Tool
rollouts"). Built from what TRL's tool loop leaves: the completion's messages and its ``tool_mask``."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
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
