"""An LLM-free "answer matches the reference" reward and its info block (the reference itself).

The answer is read from a JSON reply's ``"answer"`` field when there is one, else from the reply's last line;
both sides are compared after normalisation (case, surrounding punctuation and spaces; numbers by value).
"""

from __future__ import annotations

import re

from trl_mrtpo.utils import completion_text

from .structured import parse_json_reply


def extract_answer(text: str) -> str:
    """The ``"answer"`` of a JSON object reply, else the last non-empty line."""
    value = parse_json_reply(text)
    if isinstance(value, dict) and "answer" in value:
        return str(value["answer"])
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def normalise(answer: str) -> str:
    """Lower case, outer punctuation and spaces stripped, inner spaces collapsed; numbers written canonically."""
    text = re.sub(r"\s+", " ", answer.strip().strip(".!?,;:\"'` ").lower())
    try:
        number = float(text.replace(",", ""))
    except ValueError:
        return text
    return str(int(number)) if number.is_integer() else repr(number)


def answer_matches_reference(completions: list, reference: list[str], **kwargs) -> list[float]:
    """1 when the reply's answer equals the row's ``reference`` after normalisation, else 0."""
    return [
        float(normalise(extract_answer(completion_text(c))) == normalise(str(ref)))
        for c, ref in zip(completions, reference)
    ]


def reference_block(*, prompt, completion, row, score) -> str:
    """The reference answer, appended at replay time."""
    return f"The correct answer is: {row['reference']}"
