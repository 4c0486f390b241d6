"""Tool-calling kit: rewards, info blocks, RLLA / BFCL adapters and a small built-in training set.

Expected completion (the RLLA / ToolRL layout)::

    <think> ... </think>
    <tool_call>
    [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    </tool_call>

Inside ``<tool_call>`` a JSON list of calls, a single call object, or one call object per line are accepted; each
call is ``{"name": str, "arguments": dict}``. Model text is parsed with ``json`` only (never ``eval``).

Rewards (dataset column ``tool_calls``: the reference calls, a list or its JSON string):

- :func:`tool_format_reward` (0/1): each tag exactly once, think before tool_call, the calls parse.
- :func:`tool_correctness_reward` in [0, 1]: RLLA-style partial credit, the mean of a name score (multiset
  Jaccard of function names), a parameter-name score and a value score averaged over the reference calls (each
  reference call matched to an unused predicted call of the same name). Exactly the reference gives 1.

Info blocks (appended): :func:`tool_format_block` (the format rule), :func:`tool_reference_block` (the reference
calls). Failure boundary of the correctness reward: :func:`tool_call_boundary`, the end of the first call that does
not match the reference.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from importlib import resources
from typing import Any

from ..utils import completion_text
from . import Kit, Spans

FORMAT_RULE = (
    "Format: first reason inside <think> </think>, then give the calls inside <tool_call> </tool_call> as a JSON "
    'list of {"name": ..., "arguments": {...}} objects. Use each tag exactly once.'
)
_TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _valid_call(call: Any) -> bool:
    return isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)


def parse_calls(payload: str) -> list[dict] | None:
    """Calls from the text inside ``<tool_call>``: a JSON list, one object, or JSON lines; None if malformed."""
    payload = payload.strip()
    try:
        parsed = json.loads(payload)
        calls = parsed if isinstance(parsed, list) else [parsed]
    except (json.JSONDecodeError, RecursionError):
        try:
            calls = [json.loads(line) for line in payload.splitlines() if line.strip()]
        except (json.JSONDecodeError, RecursionError):
            return None
    if not calls or not all(_valid_call(c) for c in calls):
        return None
    return [{"name": c["name"], "arguments": c["arguments"]} for c in calls]


def extract_calls(text: str) -> list[dict] | None:
    """The calls of a well-formed completion (tags once each, think first), else None."""
    if not isinstance(text, str) or any(text.count(tag) != 1 for tag in _TAGS):
        return None
    positions = [text.index(tag) for tag in _TAGS]
    if positions != sorted(positions):
        return None
    return parse_calls(_CALL_BLOCK.search(text).group(1))


def reference_calls(value: Any) -> list[dict]:
    """Reference calls from a dataset cell: a list of calls or its JSON string (with or without the tag)."""
    if isinstance(value, str):
        match = _CALL_BLOCK.search(value)
        calls = parse_calls(match.group(1) if match else value)
    else:
        calls = list(value) if isinstance(value, (list, tuple)) and all(_valid_call(c) for c in value) else None
    if calls is None:
        raise ValueError(f"cannot read reference tool calls from {str(value)[:120]!r}")
    return calls


def _jaccard(a: Counter, b: Counter) -> float:
    union = sum((a | b).values())
    return 1.0 if union == 0 else sum((a & b).values()) / union


def _same_value(predicted: Any, expected: Any) -> bool:
    if isinstance(expected, str) and isinstance(predicted, str):
        return predicted.strip().lower() == expected.strip().lower()
    if isinstance(expected, (int, float)) and isinstance(predicted, (int, float)) and not isinstance(predicted, bool):
        return float(predicted) == float(expected)
    return predicted == expected


def _argument_scores(predicted: dict, expected: dict) -> tuple[float, float]:
    """(parameter-name Jaccard, share of expected arguments with the right value) of one call pair."""
    keys = _jaccard(Counter(predicted.keys()), Counter(expected.keys()))
    if not expected:
        return keys, float(not predicted)
    return keys, sum(k in predicted and _same_value(predicted[k], v) for k, v in expected.items()) / len(expected)


def call_score(predicted: list[dict], reference: list[dict]) -> float:
    """RLLA-style partial credit in [0, 1] (see the module docstring)."""
    name_score = _jaccard(Counter(c["name"] for c in predicted), Counter(c["name"] for c in reference))
    if not reference:
        return name_score
    unused = list(predicted)
    key_total = value_total = 0.0
    for ref in reference:
        candidates = [p for p in unused if p["name"] == ref["name"]]
        if not candidates:
            continue
        # Greedy matching: the same-name call that agrees best with this reference call.
        best = max(candidates, key=lambda p: sum(_argument_scores(p["arguments"], ref["arguments"])))
        unused.remove(best)
        keys, values = _argument_scores(best["arguments"], ref["arguments"])
        key_total += keys
        value_total += values
    return (name_score + key_total / len(reference) + value_total / len(reference)) / 3


def tool_format_reward(completions: list, **kwargs) -> list[float]:
    """1 when the think / tool_call structure is right and the calls parse."""
    return [float(extract_calls(completion_text(c)) is not None) for c in completions]


def tool_correctness_reward(completions: list, tool_calls: list, **kwargs) -> list[float]:
    """Partial credit in [0, 1] against the reference calls; 0 when the completion's calls do not parse."""
    out = []
    for completion, reference in zip(completions, tool_calls):
        calls = extract_calls(completion_text(completion))
        out.append(0.0 if calls is None else call_score(calls, reference_calls(reference)))
    return out


def tool_format_block(*, prompt, completion, row, score) -> str:
    """The format requirement the format reward checks."""
    return FORMAT_RULE


def tool_reference_block(*, prompt, completion, row, score) -> str:
    """The reference calls the correctness reward compares against."""
    return "The correct tool calls are:\n" + json.dumps(reference_calls(row["tool_calls"]))


# ---------------------------------------------------------------------------------------------------------------- data
def _call_spans(text: str) -> list[tuple[int, dict]]:
    """Each JSON object inside the ``<tool_call>`` block of ``text`` with the offset where it ends, in order
    (a list's elements or one object per line); empty when the block is missing or does not parse."""
    match = _CALL_BLOCK.search(text) if isinstance(text, str) else None
    if match is None:
        return []
    decoder, payload, base = json.JSONDecoder(), match.group(1), match.start(1)
    spans, cursor = [], 0
    while cursor < len(payload):
        char = payload[cursor]
        if char in " \t\r\n,[]":
            cursor += 1
            continue
        try:
            value, end = decoder.raw_decode(payload, cursor)
        except (json.JSONDecodeError, RecursionError):
            return spans
        if isinstance(value, dict):
            spans.append((base + end, value))
        cursor = end
    return spans


def _same_call(predicted: dict, expected: dict) -> bool:
    arguments, wanted = predicted.get("arguments"), expected["arguments"]
    return (
        predicted.get("name") == expected["name"]
        and isinstance(arguments, dict)
        and arguments.keys() == wanted.keys()
        and all(_same_value(arguments[k], v) for k, v in wanted.items())
    )


def tool_call_boundary(*, prompt, completion, row, score) -> int | None:
    """Failure boundary of :func:`tool_correctness_reward`: the end of the first call that matches no unused
    reference call (nothing after it caused the failure), or of the last call when a reference call is missing;
    None when the calls cannot be located."""
    spans = _call_spans(completion_text(completion))
    if not spans:
        return None
    unused = list(reference_calls(row["tool_calls"]))
    for end, call in spans:
        match = next((ref for ref in unused if _same_call(call, ref)), None)
        if match is None:
            return end
        unused.remove(match)
    return spans[-1][0]


def tool_prompt(question: str, functions: list[dict]) -> list[dict[str, str]]:
    """System message with the function documentation and the format rule, then the user's request."""
    system = (
        "You can call these functions:\n"
        + "\n".join(json.dumps(f) for f in functions)
        + "\n\nFirst think inside <think> </think>, then answer with the calls inside <tool_call> </tool_call> "
        'as a JSON list of {"name": ..., "arguments": {...}} objects.'
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def load_bfcl(category: str = "simple_python", limit: int | None = None) -> list[dict]:
    """BFCL single-turn rows from the data the ``bfcl-eval`` package ships (install it with ``--no-deps``).

    Each row has ``id``, ``prompt``, ``functions`` and ``possible_answer`` (BFCL's ground truth: per call, the
    acceptable values of each argument, ``""`` meaning it may be omitted), for evaluation.
    """
    try:
        data = resources.files("bfcl_eval").joinpath("data")
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError("BFCL data needs `pip install --no-deps bfcl-eval`") from error
    name = f"BFCL_v4_{category}.json"
    questions = data.joinpath(name)
    if not questions.is_file():
        available = sorted(p.name[8:-5] for p in data.iterdir() if p.name.startswith("BFCL_v4_"))
        raise ValueError(f"unknown BFCL category {category!r}; available: {', '.join(available)}")
    answers = {}
    answer_file = data.joinpath("possible_answer", name)
    if answer_file.is_file():
        for line in answer_file.read_text().splitlines():
            if line.strip():
                entry = json.loads(line)
                answers[entry["id"]] = entry["ground_truth"]
    rows = []
    for line in questions.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        if len(entry["question"]) != 1:  # multi-turn entries are out of scope for single-turn evaluation
            continue
        user = entry["question"][0][-1]["content"]
        rows.append(
            {
                "id": entry["id"],
                "prompt": tool_prompt(user, entry["function"]),
                "functions": entry["function"],
                "possible_answer": answers.get(entry["id"]),
            }
        )
        if limit is not None and len(rows) >= limit:
            break
    return rows


def load_rlla(path_or_id: str, split: str = "train", prompt_column: str = "prompt", answer_column: str = "answer"):
    """An RLLA (ToolRL) style dataset from a local parquet/JSON file or a hub id, mapped to ``prompt`` and
    ``tool_calls``. ``answer_column`` holds the reference calls (a ``<tool_call>`` block, a JSON list, or a list);
    rows whose reference cannot be read raise with the row index.
    """
    from datasets import load_dataset

    suffix = path_or_id.rsplit(".", 1)[-1].lower()
    if suffix in ("parquet", "json", "jsonl"):
        dataset = load_dataset("json" if suffix != "parquet" else "parquet", data_files=path_or_id, split=split)
    else:
        dataset = load_dataset(path_or_id, split=split)
    missing = {prompt_column, answer_column} - set(dataset.column_names)
    if missing:
        raise ValueError(f"{path_or_id} has no column(s) {sorted(missing)}; columns are {dataset.column_names}")

    def convert(row, index):
        try:
            calls = reference_calls(row[answer_column])
        except ValueError as error:
            raise ValueError(f"{path_or_id} row {index}: {error}") from error
        return {"prompt": row[prompt_column], "tool_calls": json.dumps(calls)}

    return dataset.map(convert, with_indices=True, remove_columns=dataset.column_names)


_WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city.",
    "parameters": {
        "type": "dict",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
}
_CONVERT = {
    "name": "convert_currency",
    "description": "Convert an amount between currencies.",
    "parameters": {
        "type": "dict",
        "properties": {"amount": {"type": "number"}, "source": {"type": "string"}, "target": {"type": "string"}},
        "required": ["amount", "source", "target"],
    },
}
_EMAIL = {
    "name": "send_email",
    "description": "Send an email.",
    "parameters": {
        "type": "dict",
        "properties": {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}},
        "required": ["to", "subject"],
    },
}
_TIMER = {
    "name": "set_timer",
    "description": "Start a countdown timer.",
    "parameters": {"type": "dict", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]},
}
_BUILTIN = [
    ("What's the weather in Oslo?", [_WEATHER, _TIMER], [("get_weather", {"city": "Oslo"})]),
    (
        "Weather in Austin in fahrenheit, please.",
        [_WEATHER],
        [("get_weather", {"city": "Austin", "unit": "fahrenheit"})],
    ),
    (
        "Convert 120 euros to dollars.",
        [_CONVERT, _WEATHER],
        [("convert_currency", {"amount": 120, "source": "EUR", "target": "USD"})],
    ),
    (
        "How many yen is 15 pounds?",
        [_CONVERT],
        [("convert_currency", {"amount": 15, "source": "GBP", "target": "JPY"})],
    ),
    ("Set a timer for 12 minutes.", [_TIMER, _EMAIL], [("set_timer", {"minutes": 12})]),
    (
        "Email bob@example.com with subject 'Lunch' saying see you at noon.",
        [_EMAIL, _TIMER],
        [("send_email", {"to": "bob@example.com", "subject": "Lunch", "body": "see you at noon"})],
    ),
    (
        "Check the weather in Lima and in Cairo.",
        [_WEATHER],
        [("get_weather", {"city": "Lima"}), ("get_weather", {"city": "Cairo"})],
    ),
    (
        "Start a 5 minute timer and tell me the weather in Rome.",
        [_TIMER, _WEATHER],
        [("set_timer", {"minutes": 5}), ("get_weather", {"city": "Rome"})],
    ),
    (
        "Convert 60 dollars to euros and email the team@example.com about it with subject 'Budget'.",
        [_CONVERT, _EMAIL],
        [
            ("convert_currency", {"amount": 60, "source": "USD", "target": "EUR"}),
            ("send_email", {"to": "team@example.com", "subject": "Budget"}),
        ],
    ),
    ("Is it raining in Dublin? Use celsius.", [_WEATHER], [("get_weather", {"city": "Dublin", "unit": "celsius"})]),
    ("Set a 30 minute timer.", [_TIMER], [("set_timer", {"minutes": 30})]),
    (
        "Send an email to ana@example.com, subject 'Hi'.",
        [_EMAIL],
        [("send_email", {"to": "ana@example.com", "subject": "Hi"})],
    ),
]


def make_tool_dataset():
    """The built-in tool-calling training set (12 requests over 4 functions of our own, disjoint from BFCL)."""
    from datasets import Dataset

    return Dataset.from_list(
        [
            {
                "prompt": tool_prompt(question, functions),
                "tool_calls": json.dumps([{"name": n, "arguments": a} for n, a in calls]),
            }
            for question, functions, calls in _BUILTIN
        ]
    )


def builtin_tool_dataset(num_prompts: int = 0, seed: int = 0, cache_dir: str | None = None):
    """The built-in set (every request, whatever ``num_prompts``) shuffled by ``seed``."""
    return make_tool_dataset().shuffle(seed=seed)


def _load_rlla(data_path: str | None, data_split_file: str | None = None, database_dir: str = "database"):
    if not data_path:
        raise ValueError("data_loader=rlla needs data_path (a parquet/JSON file or a hub id)")
    return load_rlla(data_path)


def tool_spans(row: dict, text: str) -> Spans:
    """The think/tool-call tags (format) and the calls' arguments (correctness)."""
    tags = [m.span() for m in re.finditer(r"</?(?:think|tool_call)>", text)]
    arguments = [m.span(1) for m in re.finditer(r'"arguments"\s*:\s*(\{[^{}]*\})', text)]
    return {"tool_format_reward": ("tags", tags), "tool_correctness_reward": ("arguments", arguments)}


KIT = Kit(
    name="tools",
    description="tool calling: format and call-correctness rewards",
    rewards=[tool_format_reward, tool_correctness_reward],
    info_blocks=[tool_format_block, tool_reference_block],
    dataset=builtin_tool_dataset,
    spans=tool_spans,
    loaders={"rlla": _load_rlla},
    failure_boundaries=[None, tool_call_boundary],
    examples="tools.jsonl",
)
