"""Run by tests/test_bad_credit.py under `accelerate launch` (two CPU processes): a relevance provider puts a NaN in q
on process 1 only; each process writes the error it raised (or that it trained) to ``<report_dir>/rank<r>.txt``."""

import faulthandler
import signal
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers import make_args
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.checks.guard import NonFiniteCredit
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.relevance import Relevance

WAIT_LIMIT_SECONDS = 240  # a rank that waits for the other this long prints where it waits and exits: a hang fails


def nan_on_process_one(policy, record):
    replayed = record.varying.clone()
    relevance = torch.zeros((*replayed.shape, record.mask.shape[1]))
    relevance[..., :2] = 1.0
    relevance = relevance * record.mask[:, None, :] * replayed[..., None]
    if record.process_index == 1:
        relevance[-1, 0, 0] = float("nan")
        replayed[-1, 0] = True
    return Relevance(relevance, replayed, bool(replayed.any()))


def main(report_dir: str, model_dir: str) -> None:
    faulthandler.dump_traceback_later(WAIT_LIMIT_SECONDS, exit=True)
    faulthandler.register(signal.SIGTERM, chain=True)
    torch.set_num_threads(1)
    trainer = MRTPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(Path(report_dir) / "out", max_steps=1, per_device_train_batch_size=4, num_generations=4),
        train_dataset=make_basic_dataset(16),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        relevance_provider=nan_on_process_one,
    )
    rank = trainer.accelerator.process_index
    try:
        trainer.train()
        outcome = f"trained {trainer.state.global_step} step(s)"
    except NonFiniteCredit as error:
        outcome = str(error)
    Path(report_dir, f"rank{rank}.txt").write_text(outcome)
    torch.distributed.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(*sys.argv[1:])
