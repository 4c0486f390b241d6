"""The ``basic`` kit: a small instruction-following task, the default of ``trl-mrtpo demo``.

Each prompt asks for a short answer on a topic under three verifiable constraints; each constraint is one 0/1
reward whose info block is its own sentence in the prompt (*in-prompt* placement), and a fourth reward (length)
has no block and keeps uniform credit.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from ..info_blocks import InfoBlock
from ..utils import completion_text, occurrences
from . import Kit, Spans

TOPICS = ["the ocean", "autumn", "a library", "coffee", "the moon", "bicycles", "rain", "a garden", "trains", "bread"]
END_PHRASES = ["Is there anything else?", "Hope this helps.", "That is all."]
KEYWORDS = ["blue", "quiet", "light", "warm", "small", "green"]
MAX_WORDS = 60


def make_basic_dataset(num_prompts: int = 32, seed: int = 0, cache_dir: str | None = None) -> Dataset:
    """Conversational prompts with three constraint sentences each; the sentences are kept in the row."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        topic, end_phrase, keyword = rng.choice(TOPICS), rng.choice(END_PHRASES), rng.choice(KEYWORDS)
        constraints = {
            "end_phrase": f'End your reply with the exact phrase "{end_phrase}"',
            "keyword": f'Use the word "{keyword}" at least once.',
            "lowercase": "Write everything in lowercase letters.",
        }
        order = list(constraints)
        rng.shuffle(order)
        text = f"Write two sentences about {topic}. " + " ".join(constraints[name] for name in order)
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "end_phrase": end_phrase,
                "keyword": keyword,
                "constraints": constraints,
            }
        )
    return Dataset.from_list(rows)


def end_phrase_reward(completions: list, end_phrase: list[str], **kwargs) -> list[float]:
    """1 when the reply ends with the requested phrase (trailing whitespace ignored)."""
    return [float(completion_text(c).rstrip().endswith(p)) for c, p in zip(completions, end_phrase)]


def keyword_reward(completions: list, keyword: list[str], **kwargs) -> list[float]:
    """1 when the requested word occurs as a whole word (case-insensitive)."""
    return [
        float(re.search(rf"\b{re.escape(k)}\b", completion_text(c), re.IGNORECASE) is not None)
        for c, k in zip(completions, keyword)
    ]


def lowercase_reward(completions: list, **kwargs) -> list[float]:
    """1 when the reply has letters and none of them is upper case."""
    return [
        float(any(ch.isalpha() for ch in completion_text(c)) and completion_text(c) == completion_text(c).lower())
        for c in completions
    ]


def length_reward(completions: list, **kwargs) -> list[float]:
    """1 for a non-empty reply of at most MAX_WORDS words (no info block: uniform credit)."""
    return [float(0 < len(completion_text(c).split()) <= MAX_WORDS) for c in completions]


def constraint_block(name: str):
    """An in-prompt info block builder: the sentence ``row["constraints"][name]`` of the prompt."""

    def builder(*, prompt, completion, row, score) -> InfoBlock:
        return InfoBlock(row["constraints"][name], placement="in_prompt")

    builder.__name__ = f"{name}_block"
    return builder


def basic_spans(row: dict, text: str) -> Spans:
    """The end phrase (its last occurrence) and the keyword."""
    return {
        "end_phrase_reward": ("end phrase", occurrences(text, row["end_phrase"], False)[-1:]),
        "keyword_reward": ("keyword", occurrences(text, row["keyword"])),
    }


KIT = Kit(
    name="basic",
    description="3 constraint rewards + length on short answers about a topic",
    rewards=[end_phrase_reward, keyword_reward, lowercase_reward, length_reward],
    info_blocks=[constraint_block("end_phrase"), constraint_block("keyword"), constraint_block("lowercase"), None],
    dataset=make_basic_dataset,
    spans=basic_spans,
    examples="basic.jsonl",
)
