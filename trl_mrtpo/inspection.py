"""``trl-mrtpo inspect``: sample, score and replay a few prompts, then show and measure where credit lands.

The localisation report (the paper's Table 4) measures, for a reward whose verifier checks a visible span of the
response (an end phrase, a keyword, the SQL fence, the tool-call tags...), ``Dist`` = share of that reward's q
mass on the span's tokens, ``Tok`` = the span's share of tokens and ``Ratio = Dist / Tok``. Beside it stands a
**control**: the same responses replayed with an irrelevant sentence of the prompt removed instead of the info
block, so a reader can tell a specific effect from rare words attracting q anyway. Both are aggregated over
responses by summing q mass and token counts (a mass-weighted mean).
"""

from __future__ import annotations

import csv
import json
import re
from collections import defaultdict
from dataclasses import dataclass

import torch

from .diagnostics import CreditRecord
from .info_blocks import InfoBlock
from .viz import token_strings

CONTROL_SENTENCE = "The museum on the corner opens at nine on Sundays."
CONTROL_NAME = "control_irrelevant_sentence"


def control_reward(completions: list, **kwargs) -> list[float]:
    """Constant 0: the control slot never changes an advantage; it only exists to be replayed."""
    return [0.0] * len(completions)


control_reward.__name__ = CONTROL_NAME


def control_block(*, prompt, completion, row, score) -> InfoBlock:
    """The irrelevant sentence, removed in the control replay."""
    return InfoBlock(CONTROL_SENTENCE, placement="in_prompt")


def with_control_sentence(prompt):
    """The prompt with the irrelevant sentence appended to its last user message."""
    if isinstance(prompt, str):
        return f"{prompt}\n{CONTROL_SENTENCE}"
    messages = [dict(m) for m in prompt]
    last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
    messages[last]["content"] = f"{messages[last]['content']}\n{CONTROL_SENTENCE}"
    return messages


def sample_credit(trainer, rows: list[dict], num_generations: int) -> CreditRecord:
    """Generate ``num_generations`` responses per row with the trainer's policy, score, replay, and return the
    batch's :class:`~trl_mrtpo.trainer.CreditRecord` (nothing is trained)."""
    inputs = [dict(row) for row in rows for _ in range(num_generations)]
    trainer.model.train()  # TRL picks train-mode group size and sampling from the module mode
    trainer._generate_and_score_completions(inputs)
    return trainer.last_credit


def load_completions(path: str) -> tuple[list[dict], list[str], int]:
    """Existing completions from a JSONL file: one line per response with ``prompt``, ``completion`` and the row
    fields the task's rewards read. Returns ``(rows, completions, group_size)``; every prompt needs the same number
    of responses, and completions come back grouped by prompt in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if "prompt" not in entry or not isinstance(entry.get("completion"), str):
                raise ValueError(f"{path} line {number}: needs 'prompt' and a string 'completion'")
            groups.setdefault(json.dumps(entry["prompt"], sort_keys=True), []).append(entry)
    sizes = {len(g) for g in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"{path}: every prompt needs the same number of completions, found {sorted(sizes)}")
    rows = [{k: v for k, v in group[0].items() if k != "completion"} for group in groups.values()]
    completions = [entry["completion"] for group in groups.values() for entry in group]
    return rows, completions, sizes.pop()


def fixed_rollout(completions: list[str]):
    """A TRL ``rollout_func`` that serves ``completions`` in order instead of sampling (for replaying existing
    responses)."""
    queue = list(completions)

    def rollout(prompts, trainer):
        if len(prompts) > len(queue):
            raise ValueError(f"{len(prompts)} prompts to answer but only {len(queue)} completions left")
        texts = [queue.pop(0) for _ in prompts]
        tokenizer = trainer.processing_class
        completion_ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        return {
            "prompt_ids": trainer._tokenize_prompts(prompts)[0],
            "completion_ids": completion_ids,
            "logprobs": None,
        }

    return rollout


# ------------------------------------------------------------------------------------------------ checkable spans
def _occurrences(text: str, needle: str, ignore_case: bool = True) -> list[tuple[int, int]]:
    flags = re.IGNORECASE if ignore_case else 0
    return [m.span() for m in re.finditer(re.escape(needle), text, flags)] if needle else []


def _if_spans(constraint: dict, text: str) -> tuple[str, list[tuple[int, int]]] | None:
    cid, kwargs = constraint["id"], constraint.get("kwargs") or {}
    if cid == "startend:end_checker":
        phrase = kwargs.get("end_phrase", "")
        spans = _occurrences(text, phrase, ignore_case=False)
        return "end phrase", spans[-1:]
    if cid == "keywords:existence":
        return "keywords", [s for k in kwargs.get("keywords", []) for s in _occurrences(text, k)]
    if cid == "keywords:frequency":
        return "keywords", _occurrences(text, kwargs.get("keyword", ""))
    if cid == "detectable_format:title":
        return "title", [m.span() for m in re.finditer(r"<<[^\n]+?>>", text)]
    if cid == "startend:quotation":
        return "quotation marks", [m.span() for m in re.finditer('"', text)]
    return None


def checkable_spans(task: str, row: dict, text: str) -> dict[int, tuple[str, list[tuple[int, int]]]]:
    """Per reward index, the span kind and character spans of the response that its verifier checks."""
    if task == "basic":
        return {
            0: ("end phrase", _occurrences(text, row["end_phrase"], False)[-1:]),
            1: ("keyword", _occurrences(text, row["keyword"])),
        }
    if task == "if":
        constraints = json.loads(row["constraints"]) if isinstance(row["constraints"], str) else row["constraints"]
        out = {}
        for k, constraint in enumerate(constraints):
            found = _if_spans(constraint, text)
            if found is not None:
                out[k] = found
        return out
    if task == "sql":
        fences = [m.span() for m in re.finditer(r"```(?:sql)?", text, re.IGNORECASE)]
        bodies = [m.span(1) for m in re.finditer(r"```sql[ \t]*\n?(.*?)```", text, re.DOTALL | re.IGNORECASE)]
        return {0: ("code fences", fences), 2: ("query body", bodies)}
    if task == "short":
        opening = re.match(r"\s*([A-Za-z]+)", text)
        closing = len(text.rstrip())
        return {
            0: ("opening word", [opening.span(1)] if opening else []),
            1: ("keyword", _occurrences(text, row["keyword"])),
            3: ("closing mark", [(closing - 1, closing)] if text.rstrip().endswith("!") else []),
        }
    if task == "tools":
        tags = [m.span() for m in re.finditer(r"</?(?:think|tool_call)>", text)]
        arguments = [m.span(1) for m in re.finditer(r'"arguments"\s*:\s*(\{[^{}]*\})', text)]
        return {0: ("tags", tags), 1: ("arguments", arguments)}
    return {}


def token_mask(tokens: list[str], spans: list[tuple[int, int]]) -> torch.Tensor:
    """Tokens overlapping any character span (token offsets from the concatenated per-token strings)."""
    mask = torch.zeros(len(tokens), dtype=torch.bool)
    position = 0
    for i, token in enumerate(tokens):
        start, end = position, position + len(token)
        mask[i] = any(s < end and start < e for s, e in spans)
        position = end
    return mask


# ------------------------------------------------------------------------------------------------ the report
@dataclass
class LocalisationRow:
    reward: str
    span: str
    responses: int
    dist: float
    tok: float
    ratio: float
    control_dist: float
    control_ratio: float


def localisation_report(
    record: CreditRecord, tokenizer, rows: list[dict], task: str, reward_names: list[str], num_generations: int
) -> list[LocalisationRow]:
    """Dist / Tok / Ratio per (reward, span kind), beside the control replay's ratio on the same spans.

    Only responses where the span occurs and both the reward and the control were replayed with non-zero q count.
    For the ``if`` task the constraint slots are pooled by span kind (slot k is a different constraint per prompt).
    """
    control = reward_names.index(CONTROL_NAME)
    totals = defaultdict(lambda: [0, 0.0, 0.0, 0.0, 0.0])  # responses, q on span, q in all, span tokens, tokens
    control_totals = defaultdict(lambda: [0.0, 0.0])
    for j, text in enumerate(record.completions):
        row = rows[j // num_generations]
        length = int(record.mask[j].sum())
        if length == 0:
            continue
        tokens = token_strings(tokenizer, record.completion_ids[j, :length].tolist())
        for k, (kind, spans) in checkable_spans(task, row, text).items():
            span = token_mask(tokens, spans)
            if not span.any() or not (record.replayed[j, k] and record.replayed[j, control]):
                continue
            q = record.relevance[j, k, :length]
            q_control = record.relevance[j, control, :length]
            if q.sum() <= 0 or q_control.sum() <= 0:
                continue
            # Instruction-following slots hold different constraints per prompt: pool them by span kind.
            key = ("if_constraint_*" if task == "if" else reward_names[k], kind)
            entry = totals[key]
            entry[0] += 1
            entry[1] += q[span].sum().item()
            entry[2] += q.sum().item()
            entry[3] += span.sum().item()
            entry[4] += length
            control_totals[key][0] += q_control[span].sum().item()
            control_totals[key][1] += q_control.sum().item()
    report = []
    for (reward, kind), (count, q_span, q_all, tok_span, tok_all) in sorted(totals.items()):
        dist, tok = q_span / q_all, tok_span / tok_all
        control_dist = control_totals[(reward, kind)][0] / control_totals[(reward, kind)][1]
        report.append(LocalisationRow(reward, kind, count, dist, tok, dist / tok, control_dist, control_dist / tok))
    return report


def write_report(report: list[LocalisationRow], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["reward", "span", "responses", "dist", "tok", "ratio", "control_dist", "control_ratio"])
        for r in report:
            writer.writerow([r.reward, r.span, r.responses, f"{r.dist:.4f}", f"{r.tok:.4f}", f"{r.ratio:.3f}",
                             f"{r.control_dist:.4f}", f"{r.control_ratio:.3f}"])  # fmt: skip


def format_report(report: list[LocalisationRow]) -> str:
    lines = [f"{'reward':<24}{'span':<16}{'n':>4}{'Dist':>8}{'Tok':>8}{'Ratio':>8}{'ctrl Ratio':>12}"]
    for r in report:
        lines.append(
            f"{r.reward:<24}{r.span:<16}{r.responses:>4}{r.dist:>8.3f}{r.tok:>8.3f}{r.ratio:>7.2f}x{r.control_ratio:>11.2f}x"
        )
    return "\n".join(lines)
