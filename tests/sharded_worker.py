"""Run by tests/test_sharded.py under `accelerate launch` (ZeRO-3 or FSDP2 on two CPU processes): 2 MRTPO steps
where the ranks' replay work differs, reporting what each rank saw."""

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path

import torch
from datasets import Dataset

from tests.helpers import merge_record
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo._trl import sharding_engine

WAIT_LIMIT_SECONDS = 180  # the test waits 400 s; alone a launch takes ~30 s


def let_fsdp_through_on_cpu() -> None:
    """Accelerate's CPU backend (MULTI_CPU) drops the FSDP plugin and runs DDP; keep the plugin so `fully_shard`
    shards the model across the CPU processes as it would across GPUs."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP  # each later init copies it back

    AcceleratorState.__init__ = init


def alpha_parity(prompts, completions, **_):
    """Varies within alpha's group only: the rank that draws 'beta' has nothing to replay."""
    return [float(len(c) % 2) if "alpha" in p else 0.0 for p, c in zip(prompts, completions)]


def alpha_vowels(prompts, completions, **_):
    return [float(sum(ch in "aeiou" for ch in c) % 3) if "alpha" in p else 1.0 for p, c in zip(prompts, completions)]


def odd_length_block(prompt, completion, **_):
    return "Answer with an odd number of characters."


def one_vowel_block(prompt, completion, **_):
    return "Use exactly one vowel."


def main(report_dir: str, model_dir: str, use_peft: str) -> None:
    faulthandler.dump_traceback_later(WAIT_LIMIT_SECONDS, exit=True)  # a hang fails fast with each rank's stack
    faulthandler.register(signal.SIGTERM, chain=True)
    if os.environ.get("ACCELERATE_USE_FSDP", "false") == "true":
        let_fsdp_through_on_cpu()
    args = MRTPOConfig(
        output_dir=str(Path(report_dir, "out")),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        credit_warmup_steps=0,
        # per-reward strength reads q over both ranks (a collective, also on the rank with nothing to replay); at
        # this floor no reward of the tiny model (1 - cos ~ 0.005) rests, so both generations replay
        reward_strength_floor=1e-6,
        # the end of text grows likelier after 2 tokens: completions end at different lengths, so that the sequences
        # one context continues into are packed side by side in one row, as a real run's are
        generation_kwargs={"exponential_decay_length_penalty": (2, 3.0)},
        seed=0,
    )
    peft_config = None
    if use_peft == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = MRTPOTrainer(
        model=model_dir,
        reward_funcs=[alpha_parity, alpha_vowels],
        info_blocks=[odd_length_block, one_vowel_block],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": "alpha: say something"}, {"prompt": "beta: say something"}] * 8),
        peft_config=peft_config,
    )
    rank = trainer.accelerator.process_index
    generations = []
    replay_inputs = trainer._replay_inputs
    original = trainer._generate_and_score_completions

    def recording_inputs(batch, joint):
        step_two, context_ids, completion_ids = replay_inputs(batch, joint)
        generations[-1].update(wanted=step_two.wanted, context_ids=context_ids, completion_ids=completion_ids)
        return step_two, context_ids, completion_ids

    def sharded(module):
        """Whether the module's parameters are sharded here: empty (ZeRO-3) or DTensors (FSDP2)."""
        params = list(module.parameters())
        return all(p.numel() == 0 or type(p).__name__ == "DTensor" for p in params)

    def recording(inputs):
        generations.append({})
        output = original(inputs)
        credit = trainer.last_credit
        layer = trainer.accelerator.unwrap_model(trainer.model).get_decoder().layers[0].mlp
        generations[-1].update(sharded_between_steps=sharded(layer), **merge_record(trainer, credit))
        torch.save(generations[-1], Path(report_dir, f"rank{rank}_generation{len(generations) - 1}.pt"))
        return output

    from trl_mrtpo import diagnostics

    means = diagnostics.process_means
    metrics = []

    def recording_means(gathered):
        metrics.append({"gathered": gathered, "logged": means(gathered)})
        return metrics[-1]["logged"]

    diagnostics.process_means = recording_means
    from trl_mrtpo import replay

    hidden, packed_rows = replay._Decoder.hidden, []

    def recording_hidden(decoder, cache, cached, rows, packed):
        if packed:  # the sequences packed side by side in one row
            packed_rows.append(len(rows))
        return hidden(decoder, cache, cached, rows, packed)

    replay._Decoder.hidden = recording_hidden
    trainer._replay_inputs = recording_inputs
    trainer._generate_and_score_completions = recording
    trainer.train()
    logged = [{k: v for k, v in entry.items() if k.startswith("mrtpo/")} for entry in trainer.state.log_history]
    report = {
        "rank": rank,
        "engine": sharding_engine(trainer),
        "global_step": trainer.state.global_step,
        "metrics": metrics,
        "logged": [entry for entry in logged if entry],
        "packed_rows": packed_rows,
    }
    Path(report_dir, f"rank{rank}.json").write_text(json.dumps(report))
    trainer.accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main(*sys.argv[1:])
