"""Two CPU processes under DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 run 2 MRTPO steps in which one rank replays and the
other has nothing to replay: no deadlock, the parameters stay sharded between steps (ZeRO-3, FSDP2; ZeRO-2 shards
only gradients and optimizer states), the replay packs completions of differing lengths into shared rows, q equals an
unsharded one-process replay of one sequence per row and every rank's token advantages equal one process's on the
merged batch."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import check_merged_advantages
from tests.test_ddp import DISTRIBUTED_VARIABLES
from trl_mrtpo.replay import replay_relevance

pytestmark = pytest.mark.slow

ENGINES = {
    "DeepSpeed ZeRO-2": "tests/accelerate/cpu_zero2.yaml",  # what the full fine-tuning recipes launch with
    "DeepSpeed ZeRO-3": "tests/accelerate/cpu_zero3.yaml",
    "FSDP2": "tests/accelerate/cpu_fsdp2.yaml",
}
PARAMETERS_SHARDED = {"DeepSpeed ZeRO-2": False, "DeepSpeed ZeRO-3": True, "FSDP2": True}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    from tests.conftest import build_tiny_model

    folder = tmp_path_factory.mktemp("tiny")
    build_tiny_model(tiny_tokenizer).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("adapter", ["lora", "none"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_sharded_replay_with_unequal_work_per_rank(tmp_path, tiny_model_dir, engine, adapter):
    if engine.startswith("DeepSpeed"):
        pytest.importorskip("deepspeed")  # in the dev extra; a contributor without it still runs the FSDP2 case
    command = [
        sys.executable, "-m", "accelerate.commands.launch",
        "--config_file", ENGINES[engine],
        "--main_process_port", "0",
        "tests/sharded_worker.py", str(tmp_path), str(tiny_model_dir), adapter,
    ]  # fmt: skip
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "DS_ACCELERATOR": "cpu"}
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=400, env=env)
    except subprocess.TimeoutExpired as error:
        stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
        pytest.fail(f"accelerate launch still running after {error.timeout} s:\n{stderr[-8000:]}")
    assert result.returncode == 0, result.stderr[-8000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # the engine that shards parameters, as the trainer's start-up checks read it (none under ZeRO-2)
        assert report["engine"] == (engine if PARAMETERS_SHARDED[engine] else None)
        assert (report["rank"], report["global_step"]) == (rank, 2)
    # MRTPO's metrics are process means, as TRL logs its own: every rank logs the same values, each the mean of the
    # ranks' values (over the ranks that have the key: a rank with nothing to replay has no q statistics)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert reports[0]["logged"] == reports[1]["logged"] and reports[0]["logged"]
    for generation in reports[0]["metrics"]:
        gathered = generation["gathered"]
        assert len(gathered) == 2
        for key, value in generation["logged"].items():
            values = [metrics[key] for metrics in gathered if key in metrics]
            assert value == pytest.approx(sum(values) / len(values)), key
    assert any(set(g["gathered"][0]) != set(g["gathered"][1]) for g in reports[0]["metrics"])  # keys differed
    # completions of differing lengths: the replay packed several sequences into one row on the sharded model
    assert any(sequences > 1 for report in reports for sequences in report["packed_rows"]), reports[0]["packed_rows"]
    generations = [[torch.load(tmp_path / f"rank{r}_generation{g}.pt") for r in (0, 1)] for g in (0, 1)]
    for parts in generations:
        assert all(p["sharded_between_steps"] == PARAMETERS_SHARDED[engine] for p in parts)  # outside the replay
        check_merged_advantages(parts)
    # the unequal work that deadlocked: a generation where one rank replays and the other has nothing to replay
    assert any(sorted(bool(any(p["wanted"])) for p in parts) == [False, True] for parts in generations), [
        [p["wanted"] for p in parts] for parts in generations
    ]
    # the first generation ran on the initial weights (a fresh adapter adds zero): q equals an unsharded replay that
    # runs each sequence whole, one per row (min_shared_prefix None: no prefix tree, nothing packed)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    for part in generations[0]:
        q = replay_relevance(model, part["context_ids"], part["completion_ids"], 1.0, min_shared_prefix=None)
        for i, ks in enumerate(part["wanted"]):
            for row, k in enumerate(ks):
                length = len(part["completion_ids"][i])
                torch.testing.assert_close(part["relevance"][i, k, :length], q[i][row], atol=1e-6, rtol=0)
