"""Multi-turn tool-calling kit: an agent shops in a small in-memory store through declared functions, reads what
they return (or the error they raise) and answers with the total it paid.

The environment (:class:`ShopEnvironment`, TRL's ``environment_factory``) exposes three tools, ``check_stock``,
``add_to_cart`` and ``checkout``. TRL's tool loop parses each call with the chat template's response schema and calls
the method by name: model text is never evaluated, a name that is not declared is refused by TRL, and every
argument is checked here against its declared type and bounds before the store is touched. Each operation is a
constant-time dictionary update on inputs capped in size (:data:`MAX_TEXT`, :data:`MAX_QUANTITY`), so a call ends
in microseconds whatever the model writes; an invalid call raises, and TRL hands the error to the model as the
tool's result.

Rewards (dataset columns ``reference_calls``, the calls that complete the task, and ``answer``, the total):

- :func:`agent_format_reward` (0/1): the trajectory ends with a plain answer (no call, no unparsed call markup) and
  every call it made ran without error.
- :func:`agent_call_reward` in [0, 1]: the calls it made against the reference, RLLA-style partial credit
  (``tool_calling.call_score``).
- :func:`agent_answer_reward` (0/1): the final answer states the total.

Info blocks are built from the environment's feedback (builders take the rollout's
:class:`~trl_mrtpo.trajectories.Trajectory`): the format rule with each failed call and its error, the reference
calls with the same, and what checkout returned with the expected total. Failure boundaries are turns: the blame of
the format and call rewards ends with the last turn whose call failed (:func:`agent_failure_turn`).
:func:`agent_turn_calls` is a process reward that scores each calling turn by the share of its calls that ran.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from ..trajectories import Trajectory, Turn, message_calls, tool_error
from . import Kit, tool_calling

MAX_TEXT = 40  # characters of an item name
MAX_QUANTITY = 99
ITEMS = {"apple": 120, "pear": 150, "lemon": 80, "plum": 60, "fig": 210, "kiwi": 90}  # price in cents
SYSTEM = (
    "You shop for the user with the tools. Check the stock, add the items to the cart, check out, then answer with "
    "the total paid."
)
FORMAT_RULE = (
    "Format: call tools only through the tool-call format; after checkout, answer in plain text with the total "
    "(e.g. 'Total: 3.60')."
)


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT:
        raise ValueError(f"{name} must be a non-empty string of at most {MAX_TEXT} characters")
    return value.strip().lower()


def _quantity(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_QUANTITY:
        raise ValueError(f"quantity must be an integer from 1 to {MAX_QUANTITY}")
    return value


def _money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


class ShopEnvironment:
    """One rollout's store: stock and prices from the row (``reset``), a cart, and the three tools."""

    def __init__(self):
        self.stock: dict[str, int] = {}
        self.prices: dict[str, int] = {}
        self.cart: dict[str, int] = {}
        self.paid: int | None = None

    def reset(self, **row) -> None:
        """Start from the row's store (``stock``: a JSON object of item -> count); the catalogue's prices. A row
        without ``stock`` is refused: it would be a silently empty store, where every call fails."""
        if "stock" not in row:
            raise ValueError(f"The agent kit's store starts from the row's 'stock' (item -> count); this row has only "
                             f"{sorted(row)}.")  # fmt: skip
        stock = json.loads(row["stock"]) if isinstance(row["stock"], str) else dict(row["stock"] or {})
        self.stock = {str(item): int(count) for item, count in stock.items()}
        self.prices = {item: ITEMS[item] for item in self.stock if item in ITEMS}
        self.cart, self.paid = {}, None

    def check_stock(self, item: str) -> str:
        """Check how many of an item the store has, and its price.

        Args:
            item: the item's name, e.g. "apple".
        """
        item = _text(item, "item")
        if item not in self.prices:
            raise ValueError(f"unknown item {item!r}")
        return f"{item}: {self.stock[item]} in stock at {_money(self.prices[item])} each"

    def add_to_cart(self, item: str, quantity: int) -> str:
        """Add an item to the cart.

        Args:
            item: the item's name, e.g. "apple".
            quantity: how many to add, from 1 to 99.
        """
        item, quantity = _text(item, "item"), _quantity(quantity)
        if item not in self.prices:
            raise ValueError(f"unknown item {item!r}")
        if self.paid is not None:
            raise ValueError("the order is already checked out")
        if self.cart.get(item, 0) + quantity > self.stock[item]:
            raise ValueError(f"only {self.stock[item]} {item} in stock")
        self.cart[item] = self.cart.get(item, 0) + quantity
        return "cart: " + ", ".join(f"{n} {name}" for name, n in sorted(self.cart.items()))

    def checkout(self) -> str:
        """Pay for the cart and place the order."""
        if not self.cart:
            raise ValueError("the cart is empty")
        if self.paid is not None:
            raise ValueError("the order is already checked out")
        self.paid = sum(self.prices[item] * n for item, n in self.cart.items())
        return f"order placed, total paid {_money(self.paid)}"


def _messages(completion: Any) -> list[dict]:
    return [m for m in completion if isinstance(m, dict)] if isinstance(completion, list) else []


def _calls(completion: Any) -> list[dict]:
    """The calls a trajectory made, as ``{"name", "arguments"}`` (TRL's parsed tool calls)."""
    return [call for message in _messages(completion) for call in message_calls(message)]


def _final_answer(completion: Any) -> str | None:
    """The last message's text when it is an answer (an assistant message without calls), else None."""
    messages = _messages(completion)
    if not messages or messages[-1].get("role") != "assistant" or messages[-1].get("tool_calls"):
        return None
    content = messages[-1].get("content")
    return content if isinstance(content, str) else None


def _failed(completion: Any) -> bool:
    """A call failed: a tool message TRL wrote as an error (read as the trajectory view reads it)."""
    return any(m.get("role") == "tool" and tool_error(m.get("content")) is not None for m in _messages(completion))


def agent_format_reward(completions: list, **kwargs) -> list[float]:
    scores = []
    for completion in completions:
        answer = _final_answer(completion)
        scores.append(
            float(bool(answer and answer.strip()) and "<tool_call>" not in answer and not _failed(completion))
        )
    return scores


def agent_call_reward(completions: list, reference_calls: list, **kwargs) -> list[float]:
    return [
        tool_calling.call_score(_calls(c), tool_calling.reference_calls(ref))
        for c, ref in zip(completions, reference_calls)
    ]


def agent_answer_reward(completions: list, answer: list, **kwargs) -> list[float]:
    return [
        float(bool(re.search(rf"(?<![\d.]){re.escape(str(total))}(?![\d])", _final_answer(c) or "")))
        for c, total in zip(completions, answer)
    ]


def _failures(trajectory: Trajectory | None) -> str:
    if trajectory is None or not trajectory.failed:
        return ""
    lines = [f"- {c.name}({json.dumps(c.arguments)}) failed with: {c.error}" for c in trajectory.failed]
    return "\nThe tools reported:\n" + "\n".join(lines)


def agent_format_block(*, prompt, completion, row, score, trajectory=None) -> str:
    return FORMAT_RULE + _failures(trajectory)


def agent_call_block(*, prompt, completion, row, score, trajectory=None) -> str:
    calls = "\n".join(json.dumps(c) for c in tool_calling.reference_calls(row["reference_calls"]))
    return "The calls that complete this order, in order:\n" + calls + _failures(trajectory)


def agent_answer_block(*, prompt, completion, row, score, trajectory=None) -> str:
    returned = [
        c.result for c in (trajectory.calls if trajectory else []) if c.name == "checkout" and c.result and not c.error
    ]
    seen = f"Checkout returned: {returned[-1]}. " if returned else ""
    return f"{seen}The correct total is {row['answer']}."


def agent_failure_turn(*, prompt, completion, row, score, trajectory=None) -> Turn | None:
    """The last turn whose call failed: the reward's blame ends there (later turns read the error and may recover)."""
    if trajectory is None:
        return None
    failing = [turn for turn in trajectory.turns if any(call.error for call in turn.calls)]
    return failing[-1] if failing else None


def agent_turn_calls(completions: list, trajectories: list, **kwargs) -> list[list | None]:
    """A process reward (the trainer's ``process_rewards``): each turn that called tools scores the share of its calls
    that ran without error, placed on the turn's last token; a completion without tool calls has no steps."""
    return [
        None
        if view is None
        else [
            (turn, sum(call.error is None for call in turn.calls) / len(turn.calls))
            for turn in view.turns
            if turn.calls
        ]
        for view in trajectories
    ]


def make_agent_dataset(num_prompts: int = 24, seed: int = 0, cache_dir: str | None = None):
    """Orders of one or two items in stores whose stock is drawn per row; the reference calls check each item's
    stock, add it and check out (2-5 calls)."""
    from datasets import Dataset

    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts or 24):
        wanted = rng.sample(sorted(ITEMS), rng.choice((1, 2)))
        order = {item: rng.randint(1, 4) for item in wanted}
        stock = {item: order.get(item, 0) + rng.randint(0, 5) for item in rng.sample(sorted(ITEMS), 4) + wanted}
        calls = [
            c
            for item, n in order.items()
            for c in (
                {"name": "check_stock", "arguments": {"item": item}},
                {"name": "add_to_cart", "arguments": {"item": item, "quantity": n}},
            )
        ] + [{"name": "checkout", "arguments": {}}]
        request = " and ".join(f"{n} {item}" for item, n in order.items())
        rows.append(
            {
                "prompt": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Please buy {request}."},
                ],
                "stock": json.dumps(stock),
                "reference_calls": json.dumps(calls),
                "answer": _money(sum(ITEMS[item] * n for item, n in order.items())),
            }
        )
    return Dataset.from_list(rows)


KIT = Kit(
    name="agent",
    description="multi-turn tool calling in a stateful store: format, call-correctness and answer rewards",
    rewards=[agent_format_reward, agent_call_reward, agent_answer_reward],
    info_blocks=[agent_format_block, agent_call_block, agent_answer_block],
    dataset=make_agent_dataset,
    failure_boundaries=[agent_failure_turn, agent_failure_turn, None],
    environment=ShopEnvironment,
)
