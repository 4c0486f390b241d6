"""A JSON-schema reward: the reply is one JSON object that satisfies the row's schema.

Model-written JSON is parsed defensively (``json.loads`` only; a code fence around it is allowed). The schema is a
small subset of JSON Schema, enough for answer formats: ``type`` (object, array, string, number, integer,
boolean, null), ``properties``, ``required``, ``items`` and ``enum``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from trl_mrtpo.utils import completion_text

_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)
_TYPES = {
    "object": dict,
    "array": list,
    "string": str,
    "boolean": bool,
    "null": type(None),
}


def parse_json_reply(text: str) -> Any:
    """The JSON value of a reply (optionally inside one ```json fence), or None when it does not parse."""
    text = text.strip()
    fenced = _FENCE.match(text)
    try:
        return json.loads(fenced.group(1) if fenced else text)
    except (ValueError, RecursionError):
        return None


def satisfies(value: Any, schema: dict) -> bool:
    """Whether ``value`` satisfies ``schema`` (the subset above; unknown keywords are ignored)."""
    kind = schema.get("type")
    if kind in ("number", "integer"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if kind == "integer" and not float(value).is_integer():
            return False
    elif kind is not None and not isinstance(value, _TYPES[kind]):
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    if isinstance(value, dict):
        if any(key not in value for key in schema.get("required", [])):
            return False
        properties = schema.get("properties", {})
        if any(key in properties and not satisfies(item, properties[key]) for key, item in value.items()):
            return False
    if isinstance(value, list) and "items" in schema:
        return all(satisfies(item, schema["items"]) for item in value)
    return True


def _schema(value: str | dict) -> dict:
    return json.loads(value) if isinstance(value, str) else value


def json_schema_reward(completions: list, schema: list, **kwargs) -> list[float]:
    """1 when the reply is JSON satisfying the row's ``schema`` (a dict or its JSON text), else 0."""
    scores = []
    for completion, row_schema in zip(completions, schema):
        value = parse_json_reply(completion_text(completion))
        scores.append(float(value is not None and satisfies(value, _schema(row_schema))))
    return scores


def schema_block(*, prompt, completion, row, score) -> str:
    """The schema the reply must satisfy, appended at replay time."""
    return "Reply with JSON that satisfies this schema: " + json.dumps(_schema(row["schema"]))
