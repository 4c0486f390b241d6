"""The benchmark scripts: pure helpers, and smoke runs of the convergence and replay-overhead benchmarks."""

import csv
import importlib.util
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convergence = load("convergence")


def test_steps_to_threshold_and_tracked_reward():
    assert convergence.steps_to_threshold([0.1, 0.79, 0.8, 0.9], 0.8, window=1) == 2  # 0-based: step 3
    assert convergence.steps_to_threshold([0.1, 0.5], 0.8, window=1) is None
    assert convergence.tracked_reward("tools", {"tool_format_reward": 0.5, "tool_correctness_reward": 0.1}) == 0.5
    # if: the mean over the constraint slots that exist (empty slots are NaN)
    assert convergence.tracked_reward("if", {"a": 1.0, "b": 0.0, "c": math.nan, "d": 0.5}) == 0.5
    assert convergence.mean_std([1.0, 3.0]) == "2.000 ± 1.414"
    assert convergence.mean_std([math.nan]) == "n/a"


@pytest.mark.slow
@pytest.mark.benchmarks
def test_convergence_quick_run_is_complete_and_resumable(tmp_path):
    """The benchmark's plumbing (every task and both code paths, the files, resume) on a small random model with the
    embedded model's tokenizer: its figures come from the embedded model itself, not from this run."""
    from trl_mrtpo.scripts.embedded import embedded_model_path

    shape = dict(num_hidden_layers=2, intermediate_size=64, hidden_size=72)
    model = load("gpu_check").random_smollm2(tmp_path / "model", embedded_model_path(), **shape)
    work, out = tmp_path / "runs", tmp_path / "results"
    argv = ["--quick", "--threads", "1", "--work-dir", str(work), "--output-dir", str(out), "--seeds", "0"]
    argv += ["--model", model]
    # mrtpo and opsd: the two code paths of a run (gdpo is mrtpo's pipeline at beta 0, tested elsewhere)
    summary = convergence.main(argv + ["--methods", "mrtpo", "opsd"])
    assert [(s["task"], s["method"]) for s in summary] == [
        (task, method) for task in ("tools", "if", "short") for method in ("mrtpo", "opsd")
    ]
    assert all(s["seeds"] == 1 for s in summary)
    for name in ("convergence_steps.csv", "convergence_summary.csv", "convergence.png", "convergence.md"):
        assert (out / name).stat().st_size > 0
    rows = list(csv.DictReader(open(out / "convergence_steps.csv")))
    assert {int(r["step"]) for r in rows} == {1, 2}
    assert {r["reward"] for r in rows if r["task"] == "tools"} == {"tool_format_reward", "tool_correctness_reward"}
    assert {r["reward"] for r in rows if r["task"] == "if"} == {f"if_constraint_{k}" for k in range(1, 14)}
    assert {r["reward"] for r in rows if r["task"] == "short"} == {
        "opening_reward",
        "keyword_reward",
        "brevity_reward",
        "ending_reward",
    }
    assert "short: every reward, first step" in (out / "convergence.md").read_text()
    assert {r["method"] for r in rows} == {"mrtpo", "opsd"}  # OPSD's rollouts are scored like the others'

    # A run interrupted after its first checkpoint resumes from it and still records both steps.
    run = work / "if" / "mrtpo" / "seed0"
    first = json.loads((run / "result.json").read_text())
    (run / "result.json").unlink()
    shutil.rmtree(run / "checkpoint-2")
    resumed = convergence.train_run("if", "mrtpo", 0, convergence.parse_args(argv))
    assert len(resumed["rewards"]) == 2
    assert json.dumps(resumed["rewards"][0]) == json.dumps(first["rewards"][0])  # step 1: from the checkpoint
    assert (run / "checkpoint-2").exists()


@pytest.mark.slow
@pytest.mark.benchmarks
def test_replay_overhead_smoke_run(tmp_path):
    """The benchmark's plumbing on a small random model with the embedded model's tokenizer (its figures come from
    the embedded model itself; loading it twice is what made this test slow)."""
    from trl_mrtpo.scripts.embedded import embedded_model_path

    shape = dict(num_hidden_layers=2, intermediate_size=64, hidden_size=72)
    model = load("gpu_check").random_smollm2(tmp_path / "model", embedded_model_path(), **shape)
    output = tmp_path / "overhead.csv"
    argv = ["--tasks", "basic", "--methods", "gdpo", "mrtpo", "--steps", "2", "--batch-size", "4", "--model", model]
    argv += ["--max-completion-length", "8", "--threads", "1", "--output", str(output)]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "replay_overhead.py"), *argv], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = list(csv.DictReader(open(output)))
    assert [(r["method"], r["step"]) for r in rows] == [("gdpo", "0"), ("gdpo", "1"), ("mrtpo", "0"), ("mrtpo", "1")]
    assert all(float(r["replay_seconds"]) == 0 for r in rows if r["method"] == "gdpo")
    assert "| basic | mrtpo |" in result.stdout


def test_paired_lines_compare_each_method_with_gdpo_by_seed():
    import argparse

    def run(method, seed, value):
        rewards = [{"a": 0.0, "b": 1.0}, {"a": value, "b": 1.0 - value}]
        return {"task": "short", "method": method, "seed": seed, "rewards": rewards}

    results = [run("gdpo", 0, 0.5), run("gdpo", 1, 0.6), run("mrtpo", 0, 0.7), run("mrtpo", 1, 0.6)]
    args = argparse.Namespace(methods=["gdpo", "mrtpo"], tasks=["short"], final_window=1)
    lines = convergence.paired_lines(results, args)
    # the tracked reward (the mean of a and b: always 0.5 here), then each reward on its own
    assert lines[-3:] == [
        "| short | mrtpo | tracked | 2 | +0.000 | 0/2/0 | 1.000 |",
        "| short | mrtpo | a | 2 | +0.100 | 1/1/0 | 1.000 |",
        "| short | mrtpo | b | 2 | -0.100 | 0/1/1 | 1.000 |",
    ]


def test_replay_scaling_smoke_run(tmp_path):
    import csv
    import subprocess
    import sys

    output = tmp_path / "scaling.csv"
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "benchmarks/replay_scaling.py", "--quick", "--output", str(output)],
        capture_output=True, text=True, env=env, check=True, timeout=300,
    )  # fmt: skip
    rows = list(csv.DictReader(output.open()))
    assert [r["varied"] for r in rows] == ["base", "num_rewards", "completion_length"]
    # more rewards and longer completions both cost more decoder tokens and more JS work
    base, more_rewards, longer = rows
    for row in (more_rewards, longer):
        assert int(row["decoder_tokens"]) > int(base["decoder_tokens"])
        assert int(row["js_pair_tokens"]) > int(base["js_pair_tokens"])
    assert "R^2" in result.stdout and output.with_suffix(".png").is_file()


@pytest.mark.parametrize("script", ["benchmarks/gpu_check.sh", "benchmarks/gpu_check.py"])
def test_gpu_check_fails_fast_without_cuda(tmp_path, script):
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the check would run")
    command = ["bash", script] if script.endswith(".sh") else [sys.executable, script]
    result = subprocess.run([*command, str(tmp_path / "out")], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr
    assert not (tmp_path / "out").exists()


def test_gpu_check_model_has_smollm2s_shape():
    sys.path.insert(0, str(BENCHMARKS))
    from gpu_check import SMOLLM2
    from transformers import AutoConfig

    from trl_mrtpo.scripts.embedded import embedded_model_path

    real = AutoConfig.from_pretrained(embedded_model_path())
    for name, value in SMOLLM2.items():
        expected = pytest.approx(value) if isinstance(value, float) else value
        assert getattr(real, name) == expected, name


def test_recorded_runs_are_reused_without_recomputing(tmp_path):
    steps = tmp_path / "steps.csv"
    steps.write_text(
        "task,method,seed,step,reward,mean\n"
        "short,gdpo,0,1,opening_reward,0.5\nshort,gdpo,0,1,ending_reward,0.0\n"
        "short,gdpo,0,2,opening_reward,0.75\nshort,gdpo,0,2,ending_reward,0.25\n"
        "short,mrtpo,0,1,opening_reward,1.0\nshort,mrtpo,0,1,ending_reward,0.5\n"
    )
    args = convergence.parse_args(["--work-dir", str(tmp_path / "runs"), "--tasks", "short"])
    assert convergence.reuse_recorded_runs(str(steps), args) == 2
    gdpo = json.loads((tmp_path / "runs" / "short" / "gdpo" / "seed0" / "result.json").read_text())
    assert gdpo["rewards"] == [
        {"opening_reward": 0.5, "ending_reward": 0.0},
        {"opening_reward": 0.75, "ending_reward": 0.25},
    ]
    assert math.isnan(gdpo["eval_after"])
    assert convergence.train_run("short", "gdpo", 0, args) == gdpo  # a finished run: read back, never retrained
    assert convergence.reuse_recorded_runs(str(steps), args) == 0  # what is there is left alone


@pytest.mark.slow
@pytest.mark.benchmarks
def test_gpu_check_dry_run_runs_every_part_on_cpu(tmp_path):
    """The GPU check's plumbing, on CPU at toy sizes (``DRY=1``): every part runs and writes its file and its summary
    line, and the step part's hash rewards make MRTPO replay, so that a lent GPU times a step that replays."""
    import os

    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "DRY": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    for part in ("step", "packing", "phases", "correctness", "js_table"):
        assert summary["parts"][part]["returncode"] == 0, (part, (out / f"{part}.log").read_text()[-3000:])
    lines = (out / "summary.txt").read_text().splitlines()
    assert [line.split(" ")[0] for line in lines[1:]] == ["step", "packing", "phases", "correctness", "js_table"]
    step = json.loads((out / "step.json").read_text())
    assert [r["step"] for r in step["gdpo"]] == [r["step"] for r in step["mrtpo"]] == [1, 2]
    assert all(r["replayed_fraction"] > 0 and r["replay_seconds"] > r["js_seconds"] > 0 for r in step["mrtpo"])
    assert all(r["replayed_fraction"] == 0 and r["replay_seconds"] == 0 for r in step["gdpo"])
    packing = json.loads((out / "packing.json").read_text())["paths"]  # the packed replay computes fewer positions
    assert 0 < packing["packed"]["positions"] < packing["padded"]["positions"]
    phases = json.loads((out / "phases.json").read_text())
    assert set(phases["phases"]) == {
        "old_logprobs",
        "forward_backward",
        *(f"replay_{c}_contexts" for c in (1.5, 2, 4)),
    }
    assert len(phases["modelled"]) == 6
    correctness = json.loads((out / "correctness.json").read_text())
    # 3 K's, TF32 off and on, bf16 states with an fp32 head, the softcap: far and near; the long chunk: near; x 2
    assert len(correctness["cases"]) == 2 * (2 * 7 + 1)
    assert all(r["max_abs_error_bits"] < 1e-5 for r in correctness["cases"])
    assert "collected" in correctness["tests"]["last_line"]
    table = json.loads((out / "js_table.json").read_text())
    assert {(r["head"], r["k"], r["method"]) for r in table["table"] if "seconds" in r} == {
        *(("bf16", k, m) for k in (1, 3) for m in ("kernel", "torch_rule", "trl_x_k", "liger_x_k")),
        ("fp32", 3, "kernel"), ("fp32", 3, "torch_rule"),
    }  # fmt: skip
    # every sweep's variant computes the default's q
    assert all(r["max_diff_from_default_bits"] < 1e-6 for r in table["chunk_sweep"] + table["block_sweep"])


@pytest.mark.slow
@pytest.mark.benchmarks
def test_a_failing_gpu_check_part_leaves_the_others_files(tmp_path):
    """A planted failure: correctness.json cannot be written (a folder stands there), so that part fails; its line
    names the failure and the log, and the next part still runs and writes its file."""
    import os

    out = tmp_path / "out"
    (out / "correctness.json").mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", str(out), "--dry-run", "--parts", "correctness", "js_table"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    lines = (out / "summary.txt").read_text().splitlines()
    assert lines[1].startswith("correctness (") and "FAILED (1): IsADirectoryError" in lines[1]
    assert "see correctness.log" in lines[1]
    assert lines[2].startswith("js_table (") and "FAILED" not in lines[2]
    assert json.loads((out / "js_table.json").read_text())["summary"] in lines[2]


def test_the_modelled_step_ratio_by_hand():
    """Replay 3, 4 and 8 s at 1.5, 2 and 4 contexts per response; old log-probabilities 1 s, forward-backward 2 s.
    At 12 % of pairs replayed, c = 1 - 0.88^3 + 0.36 = 0.678528 contexts: 0.678528 / 1.5 x 3 = 1.357056 s of replay;
    at 33 %, c = 1.689237: 3 + 0.378474 = 3.378474 s. Without generation GDPO takes 3 s, with generation = the
    forward-backward 5 s."""
    modelled_ratios = load("gpu_check").modelled_ratios
    rows = modelled_ratios({"old_logprobs": 1.0, "forward_backward": 2.0}, {1.5: 3.0, 2: 4.0, 4: 8.0})
    by = {(r["generation_assumed_s"], r["replayed_fraction"]): r for r in rows}
    assert by[(0.0, 0.12)]["replay_s"] == pytest.approx(1.357056)
    assert by[(0.0, 0.12)]["mrtpo_over_gdpo"] == pytest.approx(4.357056 / 3)
    assert by[(0.0, 0.33)]["mrtpo_over_gdpo"] == pytest.approx(6.378474 / 3)
    assert by[(2.0, 0.12)]["mrtpo_over_gdpo"] == pytest.approx(6.357056 / 5)
    assert by[(6.0, 0.33)]["contexts"] == pytest.approx(1.689237)


@pytest.mark.slow
@pytest.mark.benchmarks
def test_paper_task_dry_run_writes_the_grids_tables(tmp_path):
    """The GPU comparison command, dry (CPU, the embedded model, one step per arm): its tables are the CPU grids'."""
    import csv
    import os

    result = subprocess.run(
        ["bash", "benchmarks/paper_task.sh", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=600, env={**os.environ, "DRY_RUN": "1", "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    for name in ("convergence.md", "convergence_summary.csv", "convergence_steps.csv", "convergence.png"):
        assert (tmp_path / "out" / name).is_file(), name
    with open(tmp_path / "out" / "convergence_summary.csv") as handle:
        assert {row["method"] for row in csv.DictReader(handle)} == {"gdpo", "mrtpo"}


@pytest.mark.slow
@pytest.mark.benchmarks
def test_replay_memory_model_is_within_its_stated_margin_of_a_measured_peak():
    """benchmarks/replay_memory.md states the model within +10 % of CPU-measured peaks at Qwen2.5's width; one case
    keeps it honest (2 layers of Qwen2.5-1.5B's width and vocabulary, fp32; measured 1.07x and 1.10x)."""
    sys.path.insert(0, "benchmarks")
    from replay_memory import SHAPES, Replay, Shape, measured_peak, replay_peak_bytes

    full = SHAPES["qwen2.5-1.5b"]
    shape = Shape(full.hidden, 2, full.heads, full.kv_heads, full.intermediate, full.vocab)
    replay = Replay(4, 8, 300, 64, dtype_bytes=4)
    ratio = measured_peak(full, replay, 2) / replay_peak_bytes(shape, replay)["peak"]
    assert 0.85 <= ratio <= 1.3, ratio
    # the CUDA device rule forced on CPU, where its divergence dominates (4 GiB usable)
    device_rule = Replay(4, 3, 200, 256, dtype_bytes=4, usable=4 * 2**30)
    one_layer = Shape(full.hidden, 1, full.heads, full.kv_heads, full.intermediate, full.vocab)
    ratio = measured_peak(full, device_rule, 1) / replay_peak_bytes(one_layer, device_rule)["peak"]
    assert 0.85 <= ratio <= 1.3, ratio


def test_reward_strength_decision_applies_the_preregistered_rule(tmp_path, monkeypatch):
    """Hand-made finals: strength +0.05 on the tracked reward but behind GDPO on one reward on 6 of 8 seeds: the
    rule's second condition fails and paper-MRTPO stays the default; with that reward level, strength wins."""
    decision = load("reward_strength")
    names = ("a", "b")

    def write(behind_on_b: bool):
        committed = tmp_path / "steps.csv"
        with committed.open("w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["task", "method", "seed", "step", "reward", "mean"])
            for method, shift in (("gdpo", 0.0), ("mrtpo", 0.02)):
                for seed in decision.SEEDS:
                    for step in range(1, 13):
                        for name in names:
                            writer.writerow(["short", method, seed, step, name, 0.5 + shift])
        for seed in decision.SEEDS:
            folder = tmp_path / "runs" / f"seed{seed}"
            folder.mkdir(parents=True, exist_ok=True)
            b = 0.5 - 0.02 if behind_on_b and seed < 106 else 0.5 + 0.02
            steps = [{"a": 0.58, "b": b}] * 12
            (folder / "result.json").write_text(json.dumps({"rewards": steps}))
        monkeypatch.setattr(decision, "COMMITTED", committed)
        monkeypatch.setattr(decision, "RUNS", tmp_path / "runs")
        monkeypatch.setattr(decision, "OUTPUT", tmp_path / "decision.md")

    write(behind_on_b=True)
    text = decision.main()
    assert "| b | 0.500 | +0.020 | 0.008 | 0/8 | -0.010 | 0.289 | 6/8 |" in text  # strength: 6 behind, 2 ahead
    assert "the most is 6/8 — not met" in text and "paper-MRTPO stays the default" in text
    write(behind_on_b=False)
    assert "per-reward strength becomes the default" in decision.main()
    (tmp_path / "runs" / "seed107" / "result.json").unlink()
    with pytest.raises(SystemExit, match="seeds \\[107\\] are not finished"):
        decision.main()


@pytest.mark.slow
@pytest.mark.benchmarks
def test_the_agent_ab_kit_dry_run_trains_both_arms_and_reports_the_endpoint(tmp_path):
    """The GPU A/B kit as a user with a GPU runs it, cut to 2 steps of a tiny Qwen3 on the CPU: both arms train from
    the recipe, their trainer_state.json is read, and the pre-registered endpoint's table is written."""
    import csv
    import os

    result = subprocess.run(
        [sys.executable, "benchmarks/agent_ab.py", "run", "--dry-run", "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    endpoint = (tmp_path / "endpoint.md").read_text()
    assert "| seed | mrtpo | gdpo | mrtpo - gdpo |" in endpoint and "\n| 0 | " in endpoint
    rows = list(csv.DictReader((tmp_path / "curves.csv").open()))
    assert {row["arm"] for row in rows} == {"mrtpo", "gdpo"}
    assert (tmp_path / "mrtpo-seed0" / "adapter_config.json").is_file()


def test_the_agent_ab_analysis_says_no_data_for_short_runs_or_a_missing_metric(tmp_path):
    """Hand-made trainer states: 3 logged steps where the protocol fixes 200 are "no data", naming the runs; 200
    steps with the primary metric NaN in one run are "no data", naming it; 200 good steps ahead on every seed help."""
    agent_ab = load("agent_ab")

    def write(steps: int, value=lambda arm, seed: 0.6 if arm == "mrtpo" else 0.5):
        for arm in agent_ab.ARMS:
            for seed in agent_ab.SEEDS:
                folder = agent_ab.run_folder(tmp_path, arm, seed)
                folder.mkdir(parents=True, exist_ok=True)
                history = [{"step": s, agent_ab.PRIMARY: value(arm, seed)} for s in range(1, steps + 1)]
                (folder / "trainer_state.json").write_text(json.dumps({"log_history": history}))

    def verdict() -> str:
        return agent_ab.analyse(tmp_path).split("Verdict: ")[1].split("\n")[0]

    write(3)
    assert verdict().startswith("no data: gdpo-seed0 (3), gdpo-seed1 (3)") and "protocol's 200" in verdict()
    write(200, lambda arm, seed: math.nan if (arm, seed) == ("gdpo", 2) else 0.5)
    assert verdict() == f"no data: `{agent_ab.PRIMARY}` is missing or NaN in gdpo-seed2."
    write(200)
    assert verdict() == "MRTPO helps (positive on every seed)."


@pytest.mark.slow
@pytest.mark.benchmarks
def test_the_packing_case_dry_run_counts_positions_for_both_paths(tmp_path):
    """``replay_overhead.py --variable-length --quick``: both paths of both cases in one run; the packed replay
    computes exactly the positions needed and the padded one more."""
    output = tmp_path / "packing.csv"
    argv = ["--variable-length", "--quick", "--threads", "1", "--output", str(output)]
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / "replay_overhead.py"), *argv], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = {(r["case"], r["path"]): r for r in csv.DictReader(open(output))}
    assert set(rows) == {(c, p) for c in ("gpu_step_positions", "cpu_step_seconds") for p in ("padded", "packed")}
    for case in ("gpu_step_positions", "cpu_step_seconds"):
        packed, padded = rows[case, "packed"], rows[case, "padded"]
        assert int(packed["positions"]) == int(packed["needed"]) < int(padded["positions"])
        assert float(packed["us_per_replayed_token"]) > 0
    assert "| gpu_step_positions | packed | 1.000 |" in result.stdout
