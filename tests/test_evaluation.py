"""trl-mrtpo eval scoring, driven by scripted generators so the expected scores are known exactly."""

import json
import shutil

import pytest

from trl_mrtpo.evaluation import evaluate_bfcl, evaluate_instruction_following, evaluate_sql, format_table
from trl_mrtpo.kits.instruction_following import load_ifeval
from trl_mrtpo.kits.sql import build_demo_databases
from trl_mrtpo.kits.tool_calling import load_bfcl


def bfcl_answer(row):
    """A correct answer: the first acceptable value of every required argument (BFCL's own ground truth)."""
    calls = []
    for call in row["possible_answer"]:
        ((name, arguments),) = call.items()
        chosen = {k: v[0] for k, v in arguments.items() if v and v[0] != ""}
        calls.append({"name": name, "arguments": chosen})
    return f"<think>ok</think><tool_call>{json.dumps(calls)}</tool_call>"


def test_bfcl_accuracy_with_bfcl_own_checker():
    rows = {r["id"]: r for r in load_bfcl("simple_python", limit=10)}

    def perfect(prompts):
        return [bfcl_answer(next(r for r in rows.values() if r["prompt"] == p)) for p in prompts]

    assert evaluate_bfcl(perfect, "simple_python", limit=10).metrics["ast_accuracy"] == 1.0

    def half_wrong(prompts):
        return [
            bfcl_answer(next(r for r in rows.values() if r["prompt"] == p)) if i % 2 else "no calls"
            for i, p in enumerate(prompts)
        ]

    result = evaluate_bfcl(half_wrong, "simple_python", limit=10)
    assert result.metrics["ast_accuracy"] == 0.5 and result.count == 10
    assert result.details[0]["error"] == ["no parseable tool calls"]


def test_ifeval_strict_and_loose():
    rows = load_ifeval()[:5]
    # IFEval prompt 0: no commas, at least 3 highlighted sections, at least 300 words.
    good = "*one* *two* *three* " + "word " * 300
    loose_only = "Sure here it is\n" + good  # the first line has no comma either: still strict
    with_comma = "a, " + good

    def scripted(outputs):
        return lambda prompts: outputs[: len(prompts)]

    result = evaluate_instruction_following(scripted([good] * 5), "ifeval", limit=1)
    assert result.metrics["prompt_strict"] == 1.0 and result.metrics["instruction_strict"] == 1.0
    assert evaluate_instruction_following(scripted([loose_only]), "ifeval", limit=1).metrics["prompt_strict"] == 1.0
    commas = evaluate_instruction_following(scripted([with_comma]), "ifeval", limit=1)
    assert commas.metrics["prompt_strict"] == 0.0 and commas.metrics["instruction_strict"] == pytest.approx(2 / 3)
    bold_comma = "**note, this**\n" + good  # loose drops the first line and the asterisks: passes loosely
    bold = evaluate_instruction_following(scripted([bold_comma]), "ifeval", limit=1)
    assert bold.metrics["prompt_strict"] == 0.0 and bold.metrics["prompt_loose"] == 1.0
    assert len(rows) == 5


def test_ifbench_runs_and_reports_skips():
    result = evaluate_instruction_following(lambda prompts: ["x"] * len(prompts), "ifbench", limit=20)
    assert result.count > 0 and 0.0 <= result.metrics["instruction_loose"] <= 1.0
    assert "skipped_instructions" in format_table([result])


def test_sql_execution_accuracy(tmp_path):
    dbs = build_demo_databases(tmp_path / "db")
    (tmp_path / "spider" / "database" / "shop").mkdir(parents=True)
    shutil.copy(dbs["shop"], tmp_path / "spider" / "database" / "shop" / "shop.sqlite")
    examples = [
        {"db_id": "shop", "question": "How many customers?", "query": "SELECT count(*) FROM customers"},
        {"db_id": "shop", "question": "Largest order?", "query": "SELECT max(amount) FROM orders"},
    ]
    (tmp_path / "spider" / "dev.json").write_text(json.dumps(examples))
    answers = ["```sql\nSELECT count(id) FROM customers\n```", "```sql\nSELECT min(amount) FROM orders\n```"]
    result = evaluate_sql(lambda prompts: answers, str(tmp_path / "spider"), "dev.json")
    assert result.metrics["execution_accuracy"] == 0.5
    assert [d["correct"] for d in result.details] == [True, False]
