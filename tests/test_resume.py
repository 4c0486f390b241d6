"""The runs users resume: ``trl-mrtpo train`` with LoRA and the default credit (per-reward strength), stopped at a
checkpoint and resumed in a fresh process, on the same number of processes or another one, with other batch settings,
and with a checkpoint inside a generation buffer (``num_iterations=2``: the resumed run samples anew there, as
TRL's GRPOTrainer does). Substitutions a CPU forces: a tiny random Llama for the recipe's
model, 8-token completions, gloo for NCCL."""

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

DISTRIBUTED_VARIABLES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture
def model_dir(tmp_path, tiny_tokenizer):
    from tests.conftest import build_tiny_model

    folder = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def train(reports, model_dir, output, *extra, processes=1):
    """``trl-mrtpo train`` on the CPU recipe in a fresh process (``processes`` > 1: ``accelerate launch``); what each
    rank saw is in ``reports`` (tests/ddp_worker.py)."""
    reports.mkdir(parents=True)
    launcher = [sys.executable]
    if processes > 1:
        launcher += ["-m", "accelerate.commands.launch", "--config_file", "recipes/accelerate/cpu_ddp.yaml",
                     "--num_processes", str(processes), "--main_process_port", "0"]  # fmt: skip
    command = [
        *launcher, "tests/ddp_worker.py", str(reports),
        "--config", "recipes/cpu/basic-smollm2.yaml",
        "--model_name_or_path", str(model_dir),
        "--output_dir", str(output),
        "--max_steps", "4",
        "--max_completion_length", "8",
        "--credit_warmup_steps", "0",
        "--reward_strength_floor", "0.003",  # the tiny model's 1 - cos ~ 0.005: strengths strictly inside (0, 1)
        "--replay_only_varying", "false",  # the random model's rewards rarely vary: every pair read, state at step 2
        "--save_strategy", "steps",
        *extra,
    ]  # fmt: skip
    inherited = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-8000:]
    return [json.loads((reports / f"rank{r}.json").read_text()) for r in range(processes)]


def generations(reports, rank=0):
    found = sorted(reports.glob(f"rank{rank}_generation*.pt"), key=lambda p: int(p.stem.split("generation")[1]))
    return [torch.load(p) for p in found]


def logged_betas(output, steps):
    history = json.loads((output / "checkpoint-4" / "trainer_state.json").read_text())["log_history"]
    return [{k: v for k, v in e.items() if k.startswith("mrtpo/beta/")} for e in history if e.get("step") in steps]


def test_the_default_lora_run_resumes_exactly_in_a_fresh_process(tmp_path, model_dir):
    """Checkpoint at step 2 of 4, resumed by a new process: steps 3-4 have the uninterrupted run's betas and
    advantages, and the strength state read back is the checkpoint's."""
    train(tmp_path / "full", model_dir, tmp_path / "out", "--save_steps", "2")
    checkpoint = tmp_path / "out" / "checkpoint-2"
    (report,) = train(tmp_path / "resumed", model_dir, tmp_path / "again", "--save_steps", "2",
                      "--resume_from_checkpoint", str(checkpoint))  # fmt: skip
    saved = torch.load(checkpoint / "mrtpo_state_0.pt", weights_only=True)["parts"]["per-reward strength"][
        "specificity"
    ]
    assert not saved.isnan().all()
    (restored,) = report["restored_specificity"]
    torch.testing.assert_close(torch.tensor(restored, dtype=torch.float64), saved, equal_nan=True)
    full, resumed = generations(tmp_path / "full"), generations(tmp_path / "resumed")
    assert len(full) == 4 and len(resumed) == 2
    for after, before in zip(resumed, full[2:]):
        torch.testing.assert_close(after["beta"], before["beta"], rtol=0, atol=0)
        torch.testing.assert_close(after["advantages"], before["advantages"], rtol=0, atol=0)
    betas = logged_betas(tmp_path / "out", {3, 4})
    assert len(betas) == 2 and all(betas) and logged_betas(tmp_path / "again", {3, 4}) == betas


def test_a_checkpoint_inside_a_generation_buffer_resumes_with_a_new_sample(tmp_path, model_dir):
    """``num_iterations=2``: each generation batch trains two steps. Resumed at checkpoint-4 (a generation boundary)
    the run continues exactly: step 5 samples the uninterrupted run's third batch. Resumed at checkpoint-3 (between a
    batch's two uses) it continues from the checkpoint's MRTPO state and samples anew, as TRL's GRPOTrainer does."""
    extra = ["--num_iterations", "2", "--save_steps", "1", "--max_steps", "6"]
    train(tmp_path / "full", model_dir, tmp_path / "out", *extra)
    full = generations(tmp_path / "full")
    assert len(full) == 3
    (boundary,) = train(tmp_path / "boundary", model_dir, tmp_path / "again", *extra,
                        "--resume_from_checkpoint", str(tmp_path / "out" / "checkpoint-4"))  # fmt: skip
    (resumed,) = generations(tmp_path / "boundary")
    torch.testing.assert_close(resumed["advantages"], full[2]["advantages"], rtol=0, atol=0)
    torch.testing.assert_close(resumed["beta"], full[2]["beta"], rtol=0, atol=0)
    checkpoint = tmp_path / "out" / "checkpoint-3"
    (inside,) = train(tmp_path / "inside", model_dir, tmp_path / "inside-out", *extra,
                      "--resume_from_checkpoint", str(checkpoint))  # fmt: skip
    saved = torch.load(checkpoint / "mrtpo_state_0.pt", weights_only=True)["parts"]["per-reward strength"][
        "specificity"
    ]
    (restored,) = inside["restored_specificity"]
    torch.testing.assert_close(torch.tensor(restored, dtype=torch.float64), saved, equal_nan=True, rtol=0, atol=0)
    assert inside["global_step"] == 6 and len(generations(tmp_path / "inside")) == 2  # steps 4 and 6 sample


@pytest.mark.parametrize("changed", [["--steps_per_generation", "2"], ["--gradient_accumulation_steps", "2"]])
def test_a_resume_with_other_batch_settings_trains(tmp_path, model_dir, changed):
    """The checkpointed MRTPO state does not depend on how batches are cut: a resume with another
    ``steps_per_generation`` or ``gradient_accumulation_steps`` starts from it and trains to the end."""
    train(tmp_path / "full", model_dir, tmp_path / "out", "--save_steps", "2")
    checkpoint = tmp_path / "out" / "checkpoint-2"
    (report,) = train(tmp_path / "resumed", model_dir, tmp_path / "again", "--save_steps", "2", *changed,
                      "--resume_from_checkpoint", str(checkpoint))  # fmt: skip
    saved = torch.load(checkpoint / "mrtpo_state_0.pt", weights_only=True)["parts"]["per-reward strength"][
        "specificity"
    ]
    (restored,) = report["restored_specificity"]
    torch.testing.assert_close(torch.tensor(restored, dtype=torch.float64), saved, equal_nan=True, rtol=0, atol=0)
    assert report["global_step"] == 4 and generations(tmp_path / "resumed")


@pytest.mark.parametrize("processes", [1, 3])
def test_a_two_process_run_resumes_on_another_number_of_processes(tmp_path, model_dir, processes):
    """The strength state is global: both ranks wrote the same, and every rank of the resumed run (a new one included)
    starts from it; the resumed advantages equal one process's recomputation on the merged batch."""
    from tests.helpers import check_merged_advantages

    train(tmp_path / "full", model_dir, tmp_path / "out", "--save_steps", "2", processes=2)
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = [
        torch.load(checkpoint / f"mrtpo_state_{r}.pt", weights_only=True)["parts"]["per-reward strength"][
            "specificity"
        ]
        for r in (0, 1)
    ]
    torch.testing.assert_close(saved[0], saved[1], equal_nan=True, rtol=0, atol=0)
    assert not saved[0].isnan().all()
    reports = train(tmp_path / "resumed", model_dir, tmp_path / "again", "--save_steps", "2",
                    "--resume_from_checkpoint", str(checkpoint), processes=processes)  # fmt: skip
    for report in reports:
        (restored,) = report["restored_specificity"]
        torch.testing.assert_close(torch.tensor(restored, dtype=torch.float64), saved[0], equal_nan=True)
        assert report["num_processes"] == processes and report["global_step"] == 4
    for generation in range(2):
        check_merged_advantages([generations(tmp_path / "resumed", r)[generation] for r in range(processes)])
