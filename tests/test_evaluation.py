"""trl-mrtpo eval scoring, driven by scripted generators so the expected scores are known exactly."""

import json
import shutil

import pytest

from trl_mrtpo.kits.instruction_following import load_ifeval
from trl_mrtpo.kits.sql import build_demo_databases
from trl_mrtpo.kits.tool_calling import load_bfcl
from trl_mrtpo.scripts.evaluation import evaluate_bfcl, evaluate_instruction_following, evaluate_sql, format_table


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


def test_eval_places_the_model_on_the_accelerator(monkeypatch):
    import trl_mrtpo.scripts.policy
    from trl_mrtpo.scripts.evaluation import run_evaluation

    seen = {}

    def recording_load(model, adapter=None, device_map=None):
        seen.update(model=model, adapter=adapter, device_map=device_map)
        raise RuntimeError("stop after loading")

    monkeypatch.setattr(trl_mrtpo.scripts.policy, "load_policy", recording_load)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    with pytest.raises(RuntimeError, match="stop after loading"):
        run_evaluation(model="some/model", adapter="my-adapter", benchmarks=["ifeval"])
    assert seen == {"model": "some/model", "adapter": "my-adapter", "device_map": "auto"}


def test_vllm_backend_serves_a_lora_adapter(monkeypatch, tmp_path):
    import importlib.machinery
    import json
    import sys
    import types

    from trl_mrtpo.scripts.evaluation import vllm_generator

    calls = {}

    class LLM:
        def __init__(self, **kwargs):
            calls["llm"] = kwargs

        def chat(self, prompts, params, **kwargs):
            calls["chat"] = kwargs
            return [types.SimpleNamespace(outputs=[types.SimpleNamespace(text="ok")]) for _ in prompts]

    class LoRARequest:
        def __init__(self, name, number, path):
            self.path = path

    vllm = types.ModuleType("vllm")
    vllm.__spec__ = importlib.machinery.ModuleSpec("vllm", None)
    vllm.LLM, vllm.SamplingParams = LLM, lambda **kwargs: kwargs
    lora = types.ModuleType("vllm.lora.request")
    lora.LoRARequest = LoRARequest
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.lora", types.ModuleType("vllm.lora"))
    monkeypatch.setitem(sys.modules, "vllm.lora.request", lora)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 32}))
    generate = vllm_generator("base/model", 16, adapter=str(tmp_path))
    assert generate([[{"role": "user", "content": "hi"}]]) == ["ok"]
    assert calls["llm"] == {"model": "base/model", "enable_lora": True, "max_lora_rank": 32}
    assert calls["chat"]["lora_request"].path == str(tmp_path)


def test_a_missing_evaluation_package_is_named(monkeypatch):
    import importlib.util

    from trl_mrtpo.scripts.evaluation import evaluate

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bfcl_eval" else real(name, *a))
    with pytest.raises(ImportError, match="needs the 'bfcl_eval' package.*pip install --no-deps bfcl-eval"):
        evaluate(lambda prompts: [], "bfcl_simple_python", limit=1)
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'"):
        evaluate(lambda prompts: [], "mmlu")


def test_run_evaluation_checks_packages_before_loading_the_model(monkeypatch):
    """A missing optional package stops run_evaluation before any model is loaded."""
    import importlib.util

    import trl_mrtpo.scripts.policy
    from trl_mrtpo.scripts.evaluation import run_evaluation

    loaded = []
    monkeypatch.setattr(trl_mrtpo.scripts.policy, "load_policy", lambda *a, **k: loaded.append(a))
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "eval_framework" else real(name, *a)
    )
    with pytest.raises(ImportError, match="ifeval evaluation .* needs the 'eval_framework' package"):
        run_evaluation(benchmarks=["ifeval"])
    with pytest.raises(ValueError, match="unknown benchmark 'mmlu'"):
        run_evaluation(benchmarks=["mmlu"])
    assert not loaded
