"""What the default run loads, measured where it runs: a fresh interpreter builds ``MRTPOTrainer`` with
``MRTPOConfig``'s default credit settings on the tiny model (two rewards, each with an info block; no process
rewards; ``log_completions`` off), trains two steps (the second replays), checkpoints and saves, then counts every
line (docstrings, comments and blanks included) of every module of this distribution in ``sys.modules``. A module
loaded inside a function counts as much as one imported at the top: moving an import does not lower the figure,
deleting or not running code does.

Run ``python tests/test_default_load.py`` to print the modules and their lines.
"""

import ast
import io
import json
import os
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_mrtpo"
# The lines of this distribution's modules a default run may load: the run trains two steps (the second replays:
# beta is 0 at the first) and writes a checkpoint, as real runs do. Set at 5,194: +29 for each term's credit kept
# in every run's record (last_credit's contributions, steps and failure suffix, the completions table's line). Before:
# 5,165 when the checks came to only look
# (the guard's adapters and the wrapped steps 6-8 gone, the checks split by when they run). Before: 5,169, +123 for
# checks every run needs
# (a reward None within a group and an empty info block warned about, blocks compared in NFC, the eval dataset's
# columns, the resume's message, the card's escaping). Before: 5,046, +216 over 4,713 for the start-up
# check of the replay's path on the user's model (the rule, the probe and its fallbacks in replay.py, the
# transformers names they read in _trl.py), then +117 for state that reads back (the round trip, the construction
# check, the CPU), each process measuring its own card and sample_credit leaving the run as it was; each runs in
# every replaying run, and no core code was found that only the rooms call. Its history: 4,342 lines at the release
# before the trainer read as the method; raised for information groups (+112), the replay's memory (+206) and the
# packed replay (+20), each after moving what only the rooms call out of the core; 4,845 to 4,713 when checkpoint
# state took its one check. A feature that needs more lines on the default path makes room for them elsewhere; what a
# default run does not use (the device rule, environments' checks) is loaded where it is used.
DEFAULT_RUN_LINES_CEILING = 5194
# Each default-loaded module's part: what `python tests/test_default_load.py` and the test report, by part.
PARTS = {
    "checks": ("checks", "checks.config", "checks.inputs", "checks.batch", "checks.guard"),
    "persistence and card": ("state", "model_card", "hub_ids"),
    "observability": ("diagnostics",),
}  # every other module of the core: the method (the trainer, the config, the credit, the replay, TRL's seam)
# The rooms built on the core: none of them is loaded by a default run.
ROOMS = ("steps", "research", "gym", "kits", "scripts", "baselines", "observability")

RUN = r"""
import json, sys, tempfile
import torch
torch.set_num_threads(1)
import trl_mrtpo
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
imported = sorted(m for m in sys.modules if m.split(".")[0] == "trl_mrtpo")
from tests.conftest import build_tiny_model, build_tiny_tokenizer
from datasets import Dataset

# The tiny model's completions are noise: each reward scores a completion by its place in the batch, so that both
# vary within every group, whatever was sampled, and the step replays, as a real run's does.
def every_second(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]

def every_third(completions, **kwargs):
    return [float(i % 3 == 0) for i in range(len(completions))]

def colour_block(**kwargs):
    return "Mention the colour blue."

def length_block(**kwargs):
    return "Answer in under ten words."

tokenizer = build_tiny_tokenizer()
output_dir = tempfile.mkdtemp()
args = MRTPOConfig(
    output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=2,
    logging_steps=1, report_to="none", save_strategy="steps", save_steps=2, use_cpu=True, bf16=False,
    log_completions=False, seed=0,
)
rows = [{"prompt": [{"role": "user", "content": f"Name a colour {i}."}]} for i in range(4)]
trainer = MRTPOTrainer(
    model=build_tiny_model(tokenizer), reward_funcs=[every_second, every_third],
    info_blocks=[colour_block, length_block], args=args, train_dataset=Dataset.from_list(rows),
    processing_class=tokenizer,
)
trainer.train()
trainer.save_model(output_dir)
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "trl_mrtpo")
replayed = trainer.state.log_history[1]["mrtpo/replayed_fraction"]  # beta is 0 at the first step
print("MODULES " + json.dumps({"imported": imported, "loaded": loaded, "steps": trainer.state.global_step,
                               "replayed": replayed}))
"""


def source(name: str) -> Path | None:
    """The file of module ``name`` of this package (a package's ``__init__.py``)."""
    parts = name.split(".")[1:]
    folder = PACKAGE.joinpath(*parts)
    for path in (folder / "__init__.py", folder.with_suffix(".py") if parts else None):
        if path is not None and path.is_file():
            return path
    return None


def line_counts(path: Path) -> tuple[int, int, int]:
    """``(lines, code lines, docstring lines)`` of a module: code lines are those neither blank, nor a comment only,
    nor part of a docstring."""
    text = path.read_text()
    lines = text.splitlines()
    docstrings = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                if isinstance(body[0].value.value, str):
                    docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    comments = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT and not lines[token.start[0] - 1][: token.start[1]].strip():
            comments.add(token.start[0])
    blank = {i for i, line in enumerate(lines, 1) if not line.strip()}
    code = len(lines) - len(docstrings | comments | blank)
    return len(lines), code, len(docstrings)


def measure() -> dict:
    """Runs the default run in a fresh interpreter; returns its loaded modules and their line counts."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", RUN], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("MODULES "))
    report = json.loads(line[len("MODULES ") :])
    assert report["steps"] == 2 and report["replayed"] > 0, report  # two steps, the second replays, checkpointed
    counts = {}
    for name in report["loaded"]:
        path = source(name)
        if path is not None:
            counts[name] = line_counts(path)
    report["counts"] = counts
    return report


def totals(counts: dict, names) -> tuple[int, int, int]:
    picked = [counts[name] for name in names if name in counts]
    return tuple(sum(values) for values in zip(*picked)) if picked else (0, 0, 0)


def part(name: str) -> str:
    """The part of a loaded module (:data:`PARTS`; the method otherwise)."""
    short = name.split(".", 1)[-1]
    return next((part for part, modules in PARTS.items() if short in modules), "method")


def by_part(counts: dict) -> dict[str, int]:
    """Lines loaded per part, the method first."""
    lines = {"method": 0, **{name: 0 for name in PARTS}}
    for name, (count, _, _) in counts.items():
        lines[part(name)] += count
    return lines


def check(report: dict) -> None:
    """No room built on the core is loaded, and the total stays under the ceiling."""
    counts = report["counts"]
    rooms = [name for name in counts if len(name.split(".")) > 1 and name.split(".")[1] in ROOMS]
    assert not rooms, f"the default run loads rooms built on the core: {rooms}"
    lines = totals(counts, counts)[0]
    assert lines <= DEFAULT_RUN_LINES_CEILING, f"{lines} lines in {len(counts)} modules, by part {by_part(counts)}"


def test_the_default_run_loads_the_method_and_nothing_else():
    report = measure()
    counts = report["counts"]
    lines, code, docstrings = totals(counts, counts)
    after_import = totals(counts, report["imported"])[0]
    print(
        f"default run: {lines} lines in {len(counts)} modules ({code} code lines, {docstrings} docstring lines); "
        f"{after_import} lines after the import alone; by part {by_part(counts)}"
    )
    check(report)


def test_the_check_fails_on_a_room_or_a_line_over_the_ceiling():
    """The check itself, on a report with a lab room planted (the gym, imported by a core module) and on one a line
    over the ceiling: each fails, naming what it found."""
    counts = {"trl_mrtpo.trainer": (DEFAULT_RUN_LINES_CEILING, 1, 1)}
    check({"counts": counts})
    with pytest.raises(AssertionError, match=r"loads rooms built on the core: \['trl_mrtpo.gym.task'\]"):
        check({"counts": {**counts, "trl_mrtpo.gym.task": (1, 1, 0)}})
    with pytest.raises(AssertionError, match=f"{DEFAULT_RUN_LINES_CEILING + 1} lines in 2 modules"):
        check({"counts": {**counts, "trl_mrtpo.utils": (1, 1, 0)}})


if __name__ == "__main__":
    report = measure()
    for name, (lines, code, docstrings) in sorted(report["counts"].items()):
        print(f"{lines:5d} {code:5d} {docstrings:5d} {name}")
    lines, code, docstrings = totals(report["counts"], report["counts"])
    print(f"{lines} lines ({code} code, {docstrings} docstring) in {len(report['counts'])} modules")
    print("by part: " + ", ".join(f"{name} {count}" for name, count in by_part(report["counts"]).items()))
    print(f"after the import alone: {totals(report['counts'], report['imported'])[0]} lines")
