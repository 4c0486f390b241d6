"""The agent kit's warm start: a LoRA adapter that teaches the embedded SmolLM2-135M-Instruct to call the shop's tools.

The embedded model never emits a tool call of its own, so an MRTPO run on the agent task would see constant rewards
and replay nothing. This script makes synthetic demonstrations of the task (the kit's environment answers every call,
as TRL's tool loop would), with faults at fixed rates so that the rewards still vary under RL (a wrong item, a
malformed call, a wrong total), and trains an adapter on them with TRL's ``SFTTrainer`` (LoRA, TRL's Qwen3 training
template, ``assistant_only_loss``). The adapter ships in ``trl_mrtpo/adapters/agent-smollm2/`` with its provenance
(seed, demonstrations' hash, steps, seconds, versions); ``model_name_or_path: embedded-agent`` is the embedded model
with it merged (:func:`trl_mrtpo.scripts.embedded.local_model`).

    OMP_NUM_THREADS=1 python -m trl_mrtpo.scripts.agent_warm_start        # regenerates the shipped adapter

It runs 80 steps (128 demonstrations, 2.5 epochs; about 96 minutes on one busy CPU core, provenance.json's
``train_seconds``), checkpointing every 10 steps: run again, it resumes from the last checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

ADAPTER_DIR = Path(__file__).resolve().parents[1] / "adapters" / "agent-smollm2"
TOOL_NAMES = ("check_stock", "add_to_cart", "checkout")
# Faults per demonstration, drawn independently: the rewards of a warm-started policy still vary under RL.
FAULT_RATES = {"wrong_item": 0.15, "malformed_call": 0.10, "wrong_total": 0.15}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SEED = 1234  # the demonstrations' rows are drawn apart from the RL data's (seed 0)


def tool_schemas() -> list[dict]:
    """The shop's tools as TRL presents them to the model (their signatures and docstrings)."""
    from transformers.utils import get_json_schema

    from ..kits.tool_agent import ShopEnvironment

    environment = ShopEnvironment()
    return [get_json_schema(getattr(environment, name)) for name in TOOL_NAMES]


def _call(name: str, arguments: dict) -> dict:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}],
    }  # noqa: E501


def _result(environment, name: str, arguments: dict) -> dict:
    try:
        content = getattr(environment, name)(**arguments)
    except ValueError as error:  # TRL hands a tool's error to the model as its result
        content = f"Error: {error}"
    return {"role": "tool", "name": name, "content": content}


def demonstration(row: dict, rng: random.Random) -> tuple[list[dict], list[str]]:
    """One trajectory for ``row`` (an agent-kit row) and the faults drawn into it."""
    from ..kits.tool_agent import ITEMS, ShopEnvironment

    faults = [fault for fault, rate in FAULT_RATES.items() if rng.random() < rate]
    environment = ShopEnvironment()
    environment.reset(**row)
    messages = list(row["prompt"])
    calls = json.loads(row["reference_calls"])
    if "wrong_item" in faults:  # a call for an item the order does not name, which the store then refuses or adds
        wrong = rng.choice(sorted(set(ITEMS) - {c["arguments"].get("item") for c in calls}))
        calls.insert(0, {"name": "add_to_cart", "arguments": {"item": wrong, "quantity": 1}})
    for number, call in enumerate(calls):
        if "malformed_call" in faults and number == len(calls) - 1:  # unparseable call markup ends the trajectory
            messages.append({"role": "assistant", "content": '<tool_call>\n{"name": "checkout", "arguments": {\n'})
            return messages, faults
        messages.append(_call(call["name"], call["arguments"]))
        messages.append(_result(environment, call["name"], call["arguments"]))
    paid = environment.paid or 0
    total = paid + rng.choice((-50, 30, 100)) if "wrong_total" in faults else paid
    messages.append({"role": "assistant", "content": f"Total: {total // 100}.{total % 100:02d}"})
    return messages, faults


def demonstrations(num: int, seed: int) -> list[dict]:
    """``num`` rows of ``{"messages", "tools"}`` (SFTTrainer's conversational format with tools)."""
    from ..kits.tool_agent import make_agent_dataset

    rng = random.Random(seed)
    tools = tool_schemas()
    rows = make_agent_dataset(num, seed).to_list()
    return [{"messages": demonstration(row, rng)[0], "tools": tools} for row in rows]


def data_hash(rows: list[dict]) -> str:
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()


def train_adapter(output: Path, num: int = 128, epochs: float = 2.5, seed: int = SEED) -> dict:
    """Trains the adapter on :func:`demonstrations` and writes it with ``provenance.json``; returns the provenance.

    It checkpoints every 10 steps under ``output/run`` and resumes from the last checkpoint there, so an interrupted
    run loses at most 10 steps."""
    import os

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from ..hub_ids import local_copies, write_hub_ids
    from .embedded import embedded_model_path
    from .train import chat_template

    torch.manual_seed(seed)
    rows = demonstrations(num, seed)
    base = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    # TRL's, with generation markers: the loss on the assistant's tokens only
    tokenizer.chat_template = chat_template("qwen3_training")
    args = SFTConfig(
        output_dir=str(output / "run"),
        num_train_epochs=epochs,
        per_device_train_batch_size=4,
        learning_rate=5e-4,
        lr_scheduler_type="cosine",
        max_length=1024,
        assistant_only_loss=True,
        logging_steps=10,
        save_strategy="steps",
        save_steps=10,
        save_total_limit=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=seed,
    )
    lora = LoraConfig(
        r=8,  # every linear layer (the 64-demonstration, attention-only adapter mixed up the tools' arguments)
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=LORA_TARGETS,
        task_type="CAUSAL_LM",
    )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer, peft_config=lora
    )
    checkpoints = sorted((output / "run").glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(checkpoints[-1]) if checkpoints else None)
    seconds = time.perf_counter() - started
    output.mkdir(parents=True, exist_ok=True)
    trainer.model.save_pretrained(output)
    write_hub_ids(local_copies(trainer.model), output)  # the embedded model's Hub id, not this machine's cache path
    (output / "README.md").unlink(missing_ok=True)  # PEFT's blank card: provenance.json says what this is
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    provenance = {
        "command": "OMP_NUM_THREADS=1 python -m trl_mrtpo.scripts.agent_warm_start",
        "seed": seed,
        "demonstrations": num,
        "fault_rates": FAULT_RATES,
        "data_sha256": data_hash(rows),
        "epochs": epochs,
        "lora": {"r": 8, "alpha": 16, "targets": LORA_TARGETS},
        "resumed_from_step": int(checkpoints[-1].name.split("-")[1]) if checkpoints else 0,
        "steps": trainer.state.global_step,
        "train_seconds": round(seconds, 1),
        "threads": torch.get_num_threads(),
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    (output / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
    import shutil

    shutil.rmtree(output / "run", ignore_errors=True)
    return provenance


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ADAPTER_DIR), help="the adapter folder (default: the shipped one)")
    parser.add_argument("--demonstrations", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=2.5)
    parser.add_argument("--seed", type=int, default=SEED)
    args = parser.parse_args(argv)
    print(json.dumps(train_adapter(Path(args.output), args.demonstrations, args.epochs, args.seed), indent=1))


if __name__ == "__main__":
    main()
