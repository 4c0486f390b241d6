"""Run by tests/test_ddp.py under `accelerate launch`: trains from a recipe through the CLI's own `main` and reports
what each rank saw."""

import faulthandler
import json
import signal
import sys
from pathlib import Path

import torch

from tests.helpers import merge_record
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.scripts.train import main as train_main
from trl_mrtpo.scripts.train import make_parser
from trl_mrtpo.strength import RewardStrength

WAIT_LIMIT_SECONDS = 420  # the test's own limit is 600 s; alone the launch takes ~30 s


def main(report_dir: str, argv: list[str]) -> None:
    # A rank that waits too long prints every thread's stack and exits, so a hang fails fast and says where it waits;
    # a rank the launcher stops (because the other one exited) prints its stack too.
    faulthandler.dump_traceback_later(WAIT_LIMIT_SECONDS, exit=True)
    faulthandler.register(signal.SIGTERM, chain=True)
    shapes = []
    original = MRTPOTrainer._generate_and_score_completions

    def recording(trainer, inputs):
        output = original(trainer, inputs)
        shapes.append([list(output["advantages"].shape), bool(torch.isfinite(output["advantages"]).all())])
        credit = trainer.last_credit  # this rank's slice: what a single process recomputes on the merged batch
        rank = trainer.accelerator.process_index
        torch.save(merge_record(trainer, credit), Path(report_dir, f"rank{rank}_generation{len(shapes) - 1}.pt"))
        return output

    MRTPOTrainer._generate_and_score_completions = recording
    restored = []  # the per-reward strength each rank resumed with (a resume only)
    restore = RewardStrength.restore

    def restoring(strength, state):
        restored.append(state["specificity"].tolist())
        return restore(strength, state)

    RewardStrength.restore = restoring
    trainer = train_main(*make_parser().parse_args_and_config(argv))
    state = trainer.accelerator.state
    report = {
        "rank": state.process_index,
        "num_processes": state.num_processes,
        "backend": str(state.backend),
        "global_step": trainer.state.global_step,
        "advantages": shapes,
        "restored_specificity": restored,
        # a process group left alive at exit can abort the interpreter's shutdown (gloo's threads)
        "process_group_destroyed": not torch.distributed.is_initialized(),
    }
    Path(report_dir, f"rank{state.process_index}.json").write_text(json.dumps(report))
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
