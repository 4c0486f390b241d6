"""Run by tests/test_agent_credit.py under `accelerate launch` (DDP, two CPU processes): 2 MRTPO steps on tool
rollouts made by TRL's own tool loop, with a per-turn process reward and failure turns, each rank saving what it
computed."""

import faulthandler
import signal
import sys
from pathlib import Path

import torch
from datasets import Dataset

from tests.conftest import build_tiny_tokenizer
from tests.helpers import merge_record
from tests.test_agent_credit import (
    QUESTION,
    first_turn,
    lookup,
    recording_step_rules,
    scripted_trainer,
    tool_tokenizer,
    turn_scores,
)

WAIT_LIMIT_SECONDS = 180  # the test waits 400 s; alone a launch takes ~30 s


def main(report_dir: str) -> None:
    faulthandler.dump_traceback_later(WAIT_LIMIT_SECONDS, exit=True)  # a hang fails fast with each rank's stack
    faulthandler.register(signal.SIGTERM, chain=True)
    tokenizer = tool_tokenizer(build_tiny_tokenizer())
    trainer = scripted_trainer(
        tokenizer,
        Path(report_dir, "out"),
        Dataset.from_list([{"prompt": QUESTION}] * 16),
        config=dict(num_generations=8),  # each group spans both ranks: its step statistics need the gather
        tools=[lookup],
        process_rewards=[turn_scores],
        failure_boundaries=[first_turn, first_turn],
    )
    step_rules = recording_step_rules(trainer, tokenizer)
    trainer.train()
    rank = trainer.accelerator.process_index
    for g, (credit, batch, rules) in enumerate(zip(trainer.credits, trainer.batches, step_rules)):
        record = {
            **merge_record(trainer, credit),
            "tool_mask": batch["tool_mask"],
            "process": rules["process"],
            "failure_suffix": rules["failure_suffix"],
            "steps": rules["steps"],
            "boundaries": rules["boundaries"],
        }
        torch.save(record, Path(report_dir, f"rank{rank}_generation{g}.pt"))
    trainer.accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(sys.argv[1])
