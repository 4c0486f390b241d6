"""What the default run loads, measured where it runs: a fresh interpreter builds ``MRTPOTrainer`` with
``MRTPOConfig``'s default credit settings on the tiny model (two rewards, each with an info block; no process rewards;
``log_completions`` off), trains one step and saves, then counts every line (docstrings, comments and blanks
included) of every module of this distribution in ``sys.modules``. A module loaded inside a function counts as much as
one imported at the top: moving an import does not lower the figure, deleting or not running code does.

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

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_mrtpo"
# Lines of this distribution's modules a default run loads: 5,110 in 27 modules (3,409 code lines, 933 docstring
# lines) when this test landed; 3,922 in 20 (2,567 code, 742 docstring) once the step credit, the Triton kernel and
# the tool-rollout views loaded only when used, the token scores moved to the research room, and the shims, the
# generation-buffer checkpoint and a second composition of steps 5-8 went; 3,864 (2,536 code, 730 docstring) once
# the helpers of the kits, the gym and the commands left utils.py for their users; 3,851 (2,516 code, 732 docstring)
# with the trainer at 486 lines; 3,945 (2,578 code, 750 docstring) with the device rule of the replay divergence
# (ops.divergence.workspace_divergence: CUDA chunks from a fixed workspace, +95); 4,071 (2,674 code, 760 docstring)
# with the model card every save writes (model_card, loaded by save_model, +126); 4,077 with model="embedded"
# refused by name (+6); 4,076 once one helper named users' functions for the trainer and the card; 4,166 (2,746 code,
# 771 docstring) with info-block builders checked on the first row before the model loads (+62), the warning on a
# reward that is None for a whole first batch (+24), activation checkpointing passed to transformers 5.17 (+8) and the
# embedded model's card note (+8), less the live adapter config left alone (-15); 4,204 (2,769 code, 778 docstring)
# with TRL's environment-owned rewards and data (+38); 4,203 (2,793 code, 766 docstring) with one registry of rules,
# terms passed in, providers that take a record and nothing of the user's patched after construction; 4,192 (2,788
# code, 762 docstring) once the divergence backend became a choice (no registry); 4,200 with a provider called
# whenever the rule reads q and refused with a rule that reads none (+8); 4,288 with what a rule, term or provider
# returns checked where it enters (extension_outputs, +88); 4,342 with checkpoint state checked when written (each
# entry owned, declared, written and readable by the safe loader; a newer release's file named, +54); 4,436 with the
# fp32-output GEMM guarded by torch release, device and capability (torch 2.6-2.7 and torch 2.11's addmm had failed),
# Gemma 2's final_logit_softcapping replayed instead of refused, and "auto" settled once at start-up (+94); 4,500 with
# environments' rewards checked where they return, a term's relevance() checked for shape and sign, credit computed
# under no_grad, credit_terms type-checked, and the state serialised before the checkpoint with a refusal naming
# missing and extra entries (+64); 4,575 with reward columns checked before the model loads, the warm-up as a share of
# max_steps with its short-run warning, and the reset() refusal read from TRL's environments and Python's error text
# instead of TRL's frame (+75); 4,578 with a tool run's card naming its environments, tools and template (+3; the
# lines themselves load with the tool rollouts). It only falls; a rise names the feature that needs the lines, here.
DEFAULT_RUN_LINES_CEILING = 4578
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

def says_blue(completions, **kwargs):
    return [float("blue" in str(c)) for c in completions]

def is_short(completions, **kwargs):
    return [float(len(str(c)) < 60) for c in completions]

def colour_block(**kwargs):
    return "Mention the colour blue."

def length_block(**kwargs):
    return "Answer in under ten words."

tokenizer = build_tiny_tokenizer()
output_dir = tempfile.mkdtemp()
args = MRTPOConfig(
    output_dir=output_dir, per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=1,
    logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, log_completions=False, seed=0,
)
rows = [{"prompt": [{"role": "user", "content": f"Name a colour {i}."}]} for i in range(4)]
trainer = MRTPOTrainer(
    model=build_tiny_model(tokenizer), reward_funcs=[says_blue, is_short], info_blocks=[colour_block, length_block],
    args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
)
trainer.train()
trainer.save_model(output_dir)
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "trl_mrtpo")
print("MODULES " + json.dumps({"imported": imported, "loaded": loaded, "steps": trainer.state.global_step}))
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
    assert report["steps"] == 1
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


def test_the_default_run_loads_the_method_and_nothing_else():
    report = measure()
    counts = report["counts"]
    lines, code, docstrings = totals(counts, counts)
    after_import = totals(counts, report["imported"])[0]
    print(
        f"default run: {lines} lines in {len(counts)} modules ({code} code lines, {docstrings} docstring lines); "
        f"{after_import} lines after the import alone"
    )
    rooms = [name for name in counts if len(name.split(".")) > 1 and name.split(".")[1] in ROOMS]
    assert not rooms, f"the default run loads rooms built on the core: {rooms}"
    assert lines <= DEFAULT_RUN_LINES_CEILING, f"{lines} lines in {len(counts)} modules: {counts}"


if __name__ == "__main__":
    report = measure()
    for name, (lines, code, docstrings) in sorted(report["counts"].items()):
        print(f"{lines:5d} {code:5d} {docstrings:5d} {name}")
    lines, code, docstrings = totals(report["counts"], report["counts"])
    print(f"{lines} lines ({code} code, {docstrings} docstring) in {len(report['counts'])} modules")
    print(f"after the import alone: {totals(report['counts'], report['imported'])[0]} lines")
