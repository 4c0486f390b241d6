"""Short answers under four checkable constraints: a task the embedded SmolLM2-135M-Instruct already meets part of
the time, so that every credit mode can move it within a CPU budget.

Each prompt asks one short question and states four constraints, each one sentence of the prompt and one 0/1
reward whose info block is that sentence (*in-prompt* placement). The constraints differ in where they bind:

- ``opening``: the reply starts with a given word (its first token);
- ``keyword``: a given word occurs anywhere (free position; the demo task's reward);
- ``brevity``: at most ``MAX_WORDS`` words (global: every token, and where the reply stops);
- ``ending``: the reply ends with an exclamation mark (its last token).
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from ..utils import completion_text, occurrences
from . import Kit, Spans
from .basic import constraint_block, keyword_reward

QUESTIONS = [
    "Name a fruit.",
    "Name an animal that lives in the sea.",
    "What colour is the sky?",
    "Name a musical instrument.",
    "What do bees make?",
    "Name a season of the year.",
    "What is frozen water called?",
    "Name something you can read.",
    "What do cows drink?",
    "Name a planet.",
    "What do you use to write on paper?",
    "Name a vegetable.",
]
OPENINGS = ["The", "A"]
KEYWORDS = ["happy", "little", "nice", "great"]
CONSTRAINTS = ("opening", "keyword", "brevity", "ending")
MAX_WORDS = 12


def constraint_sentences(opening: str, keyword: str) -> dict[str, str]:
    return {
        "opening": f'Start your reply with the word "{opening}".',
        "keyword": f'Use the word "{keyword}".',
        "brevity": f"Use at most {MAX_WORDS} words.",
        "ending": "End your reply with an exclamation mark.",
    }


def make_short_answer_dataset(num_prompts: int = 64, seed: int = 0, cache_dir: str | None = None) -> Dataset:
    """Conversational prompts: a question and the four constraint sentences in a random order."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        opening, keyword = rng.choice(OPENINGS), rng.choice(KEYWORDS)
        sentences = constraint_sentences(opening, keyword)
        order = list(CONSTRAINTS)
        rng.shuffle(order)
        text = f"{rng.choice(QUESTIONS)} Answer in one short sentence. " + " ".join(sentences[n] for n in order)
        rows.append(
            {
                "prompt": [{"role": "user", "content": text}],
                "opening": opening,
                "keyword": keyword,
                "constraints": sentences,
            }
        )
    return Dataset.from_list(rows)


def opening_reward(completions: list, opening: list[str], **kwargs) -> list[float]:
    """1 when the reply's first word is the requested one (case-insensitive, punctuation after it ignored)."""
    out = []
    for c, word in zip(completions, opening):
        match = re.match(r"\s*([A-Za-z]+)", completion_text(c))
        out.append(float(match is not None and match.group(1).lower() == word.lower()))
    return out


def brevity_reward(completions: list, **kwargs) -> list[float]:
    """1 for a non-empty reply of at most ``MAX_WORDS`` words."""
    return [float(0 < len(completion_text(c).split()) <= MAX_WORDS) for c in completions]


def ending_reward(completions: list, **kwargs) -> list[float]:
    """1 when the reply's last non-space character is an exclamation mark."""
    return [float(completion_text(c).rstrip().endswith("!")) for c in completions]


def short_answer_spans(row: dict, text: str) -> Spans:
    """The opening word, the keyword and the closing exclamation mark (brevity binds everywhere: no span)."""
    opening = re.match(r"\s*([A-Za-z]+)", text)
    closing = len(text.rstrip())
    return {
        "opening_reward": ("opening word", [opening.span(1)] if opening else []),
        "keyword_reward": ("keyword", occurrences(text, row["keyword"])),
        "ending_reward": ("closing mark", [(closing - 1, closing)] if text.rstrip().endswith("!") else []),
    }


KIT = Kit(
    name="short",
    description="short answers under 4 constraints (opening word, keyword, brevity, ending '!')",
    rewards=[opening_reward, keyword_reward, brevity_reward, ending_reward],
    info_blocks=[constraint_block(name) for name in CONSTRAINTS],
    dataset=make_short_answer_dataset,
    spans=short_answer_spans,
    examples="short.jsonl",
)
