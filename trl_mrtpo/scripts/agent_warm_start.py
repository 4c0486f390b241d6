"""The agent kit's warm start: a LoRA adapter that teaches the embedded SmolLM2-135M-Instruct to call the shop's tools.

The embedded model never emits a tool call of its own, so an MRTPO run on the agent task would see constant rewards
and replay nothing. This script makes synthetic demonstrations of the task (the kit's environment answers every call,
as TRL's tool loop would), with faults at fixed rates so that the rewards still vary under RL (a wrong item, a
malformed call, a wrong total), and trains an adapter on them with TRL's ``SFTTrainer`` (LoRA, TRL's Qwen3 training
template, ``assistant_only_loss``). The adapter ships in ``trl_mrtpo/adapters/agent-smollm2/`` with its provenance
(seed, demonstrations' hash, steps, seconds, versions); ``model_name_or_path: embedded-agent`` is the embedded model
with it merged (:func:`trl_mrtpo.scripts.embedded.local_model`).

    OMP_NUM_THREADS=1 python -m trl_mrtpo.scripts.agent_warm_start --overwrite   # regenerates the shipped adapter
    OMP_NUM_THREADS=1 python -m trl_mrtpo.scripts.agent_warm_start --output DIR  # a new or empty DIR

It runs 80 steps (128 demonstrations, 2.5 epochs; about 96 minutes on one busy CPU core, provenance.json's
``train_seconds``), checkpointing every 10 steps in its own folder inside the output (``.warm-start``, marked with
the arguments): run again with the same arguments, it resumes from the last checkpoint there, and removes that folder
once the adapter is written. It writes only ``adapter_config.json``, ``adapter_model.safetensors`` and
``provenance.json`` beside it: an output folder holding anything else is refused unless ``--overwrite`` is given, and
even then nothing of another's is removed or resumed from.
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
WORK = ".warm-start"  # the script's own folder inside the output: checkpoints and the save, removed when done
WORK_MARKER = "warm_start_arguments.json"  # what marks the folder as this script's, for these arguments
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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


def arguments_problem(num: int, epochs: float) -> str | None:
    """What makes a run train nothing: no demonstrations, or no epoch (an untrained adapter)."""
    if isinstance(num, bool) or not isinstance(num, int) or num < 1:
        return f"--demonstrations must be an integer >= 1, got {num!r}: there would be nothing to train on."
    if not epochs > 0:
        return f"--epochs must be > 0, got {epochs!r}: the adapter would be written untrained."
    return None


# What this script writes into provenance.json: a file holding them all is its own.
PROVENANCE_KEYS = {"command", "arguments", "seed", "demonstrations", "fault_rates", "data_sha256", "lora"}


def json_dict(path: Path) -> dict | None:
    """The JSON object in the plain file at ``path``; None for anything else (a link, a folder, not JSON)."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        held = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) else None


def written_here(entry: Path) -> bool:
    """What this script wrote in its output folder, recognised by content, never by name alone: its provenance
    (every key it writes), the adapter files beside that provenance, and its work folder (a folder holding its
    marker)."""
    provenance = json_dict(entry.parent / "provenance.json")
    if entry.name == "provenance.json" or entry.name in ADAPTER_FILES:
        return provenance is not None and PROVENANCE_KEYS <= set(provenance) and not entry.is_symlink()
    return entry.name == WORK and not entry.is_symlink() and json_dict(entry / WORK_MARKER) is not None


def work_folder(output: Path, arguments: dict, overwrite: bool) -> Path:
    """The script's own folder inside ``output``, after refusing an output that holds what it did not write
    (:func:`~trl_mrtpo.outputs.writable_folder`, :func:`written_here`). A work folder marked with other arguments is
    this script's and is removed (its checkpoints would train another adapter); one without the mark, or a link, is
    another's: refused."""
    import shutil

    from ..outputs import OutputRefused, not_plain, writable_folder, write_output

    writable_folder(output, overwrite, own=written_here)
    work = output / WORK
    marker = work / WORK_MARKER
    if (kind := not_plain(work)) is not None:
        raise OutputRefused(f"{work} is {kind}, not this script's work folder; remove it yourself.")
    if work.exists():
        marked = json_dict(marker)
        if marked is None:
            raise OutputRefused(
                f"{work} exists but was not made by this script ({marker} is missing or is not its JSON); remove it "
                "yourself."
            )
        if marked != arguments:
            shutil.rmtree(work)  # this script's, for other arguments: never resumed from
    work.mkdir(parents=True, exist_ok=True)
    write_output(marker, json.dumps(arguments, sort_keys=True))
    return work


def train_adapter(
    output: Path,
    num: int = 128,
    epochs: float = 2.5,
    seed: int = SEED,
    overwrite: bool = False,
    command: str = "python -m trl_mrtpo.scripts.agent_warm_start",
) -> dict:
    """Trains the adapter on :func:`demonstrations` and writes it with ``provenance.json``; returns the provenance.

    It checkpoints every 10 steps in its own folder inside ``output`` (:func:`work_folder`) and resumes from the last
    checkpoint there when run again with the same arguments, so an interrupted run loses at most 10 steps."""
    import os
    import shutil

    from ..outputs import write_output

    problem = arguments_problem(num, epochs)
    if problem:
        raise ValueError(problem)
    arguments = {"demonstrations": num, "epochs": epochs, "seed": seed}
    work = work_folder(output, arguments, overwrite)  # before anything loads

    import torch
    import transformers
    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from ..chat_templates import chat_template
    from ..hub_ids import local_copies, write_hub_ids
    from .embedded import embedded_model_path

    torch.manual_seed(seed)
    rows = demonstrations(num, seed)
    base = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(base)
    # TRL's, with generation markers: the loss on the assistant's tokens only
    tokenizer.chat_template = chat_template("qwen3_training")
    args = SFTConfig(
        output_dir=str(work),
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
    checkpoints = sorted(work.glob("checkpoint-*"), key=lambda path: int(path.name.split("-")[1]))
    started = time.perf_counter()
    trainer.train(resume_from_checkpoint=str(checkpoints[-1]) if checkpoints else None)
    seconds = time.perf_counter() - started
    saved = work / "adapter"  # saved inside the work folder: PEFT's blank card stays there and goes with it
    trainer.model.save_pretrained(saved)
    write_hub_ids(local_copies(trainer.model), saved)  # the embedded model's Hub id, not this machine's cache path
    for name in ADAPTER_FILES:
        os.replace(saved / name, output / name)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    provenance = {
        "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} {command}".strip(),
        "arguments": arguments,
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
    write_output(output / "provenance.json", json.dumps(provenance, indent=1) + "\n")
    shutil.rmtree(work)  # the script's own folder, and only it
    return provenance


def main(argv: list[str] | None = None) -> None:
    import shlex
    import sys

    from ..outputs import OutputRefused

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=str(ADAPTER_DIR), help="the adapter folder (default: the shipped one)")
    parser.add_argument("--demonstrations", type=int, default=128)
    parser.add_argument("--epochs", type=float, default=2.5)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument(
        "--overwrite", action="store_true", help="write into a folder holding other files (none is removed)"
    )
    args = parser.parse_args(argv)
    problem = arguments_problem(args.demonstrations, args.epochs)
    if problem:
        parser.error(problem)
    command = shlex.join(["python", "-m", "trl_mrtpo.scripts.agent_warm_start", *argv])
    try:
        provenance = train_adapter(
            Path(args.output), args.demonstrations, args.epochs, args.seed, args.overwrite, command
        )
    except OutputRefused as refused:  # checked before anything loads
        parser.error(str(refused))
    print(json.dumps(provenance, indent=1))


if __name__ == "__main__":
    main()
