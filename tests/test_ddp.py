"""Two CPU processes (DDP over gloo) run 2 MRTPO steps through accelerate launch and the CPU recipe."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_accelerate_launch_two_cpu_processes(tmp_path, tiny_tokenizer):
    from tests.conftest import build_tiny_model

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    reports = tmp_path / "reports"
    reports.mkdir()
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", "recipes/accelerate/cpu_ddp.yaml",
        "tests/ddp_worker.py", str(reports),
        "--config", "recipes/cpu/basic-smollm2.yaml",
        "--model_name_or_path", str(model_dir),
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "2",
        "--max_completion_length", "8",
        "--credit_warmup_steps", "0",
        "--replay_only_varying", "false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = sorted(json.loads(p.read_text())["rank"] for p in reports.glob("rank*.json"))
    assert seen == [0, 1]
    for path in reports.glob("rank*.json"):
        report = json.loads(path.read_text())
        assert report["num_processes"] == 2 and report["backend"] == "gloo" and report["global_step"] == 2
        assert report["advantages"] and all(finite and len(shape) == 2 for shape, finite in report["advantages"])
