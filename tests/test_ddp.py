"""Two CPU processes (DDP over gloo) run 2 MRTPO steps through accelerate launch, the CPU recipe and the CLI's
`main`."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import check_merged_advantages
from tests.reference import reference_strength_betas

pytestmark = pytest.mark.slow

DISTRIBUTED_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


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
        "--main_process_port", "0",  # a free port: another launch on this machine cannot join this one's group
        "tests/ddp_worker.py", str(reports),
        "--config", "recipes/cpu/basic-smollm2.yaml",
        "--model_name_or_path", str(model_dir),
        "--output_dir", str(tmp_path / "out"),
        "--max_steps", "2",
        "--max_completion_length", "8",
        "--credit_warmup_steps", "0",
        "--replay_only_varying", "false",
        "--reward_strength_floor", "0.003",  # the tiny model's 1 - cos ~ 0.005: strengths strictly inside (0, 1)
    ]  # fmt: skip
    # The launcher sets the ranks' own distributed variables; none of the test process's may leak into them.
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired as error:  # the launcher itself waits: show what the ranks printed
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
        pytest.fail(f"accelerate launch still running after {error.timeout} s:\n{stderr[-8000:]}")
    assert result.returncode == 0, result.stderr[-8000:]
    seen = sorted(json.loads(p.read_text())["rank"] for p in reports.glob("rank*.json"))
    assert seen == [0, 1]
    for path in reports.glob("rank*.json"):
        report = json.loads(path.read_text())
        assert report["num_processes"] == 2 and report["backend"] == "gloo" and report["global_step"] == 2
        assert report["advantages"] and all(finite and len(shape) == 2 for shape, finite in report["advantages"])
        assert report["process_group_destroyed"], "trl-mrtpo train must destroy the process group before exiting"
    # Steps 7 and 8 see the whole generation batch: the ranks' advantages equal one process's on the merged batch.
    generations = sorted({p.name.split("_")[1] for p in reports.glob("rank0_generation*.pt")})
    assert generations
    for generation in generations:
        check_merged_advantages([torch.load(reports / f"rank{r}_{generation}") for r in (0, 1)])
    # Per-reward strength reads the whole batch: the first generation's betas are those of the merged batch's q.
    first = [torch.load(reports / f"rank{r}_generation0.pt") for r in (0, 1)]
    width = max(part["mask"].shape[1] for part in first)
    relevance = torch.cat(
        [torch.nn.functional.pad(p["relevance"], (0, width - p["relevance"].shape[-1])) for p in first]
    )
    replayed = torch.cat([p["replayed"] for p in first])
    expected = reference_strength_betas([(relevance, replayed)], [0.5], 0.003, num_rewards=replayed.shape[1])[0]
    torch.testing.assert_close(
        first[0]["beta"].double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6, rtol=0
    )
    assert any(0 < b < 0.5 for b in expected), expected
