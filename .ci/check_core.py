"""Run in a fresh venv where only the bare wheel (the core install, no extras) is installed, outside the source tree:
MRTPOTrainer trains two steps with a user-written reward and info block on a tiny model built here, and no kit,
demo or plotting dependency is installed or imported. Then `trl-mrtpo train` trains a recipe whose reward, info
block and process reward are the user's, named by dotted path (no kit may be needed to resolve them)."""

import importlib.util
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from datasets import Dataset

import trl_mrtpo
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.gym import build_tokenizer
from trl_mrtpo.gym.task import GymSpec, build_policy
from trl_mrtpo.utils import function_name

assert "site-packages" in trl_mrtpo.__file__, f"imported from the source tree: {trl_mrtpo.__file__}"
extras = ["sqlglot", "if_verifiable", "nltk", "gguf", "matplotlib"]
assert not [m for m in extras if importlib.util.find_spec(m)], "the bare wheel pulled an extra's package"
torch.set_num_threads(1)


def says_red(completions, **kwargs):  # a user's reward
    return [float("red" in c[-1]["content"].split()) for c in completions]


def red_block(*, prompt, completion, row, score):  # and its info block: the constraint's span of the prompt
    return trl_mrtpo.InfoBlock("has red ;", placement="in_prompt")


tokenizer = build_tokenizer()
prompts = [[{"role": "user", "content": "has red ; first cat ;"}]] * 4
with tempfile.TemporaryDirectory() as output_dir:
    trainer = MRTPOTrainer(
        model=build_policy(tokenizer, GymSpec(), seed=0),
        reward_funcs=[says_red],
        info_blocks=[red_block],
        args=MRTPOConfig(
            output_dir=output_dir,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=6,
            max_steps=2,
            credit_warmup_steps=0,
            replay_only_varying=False,
            use_cpu=True,
            bf16=False,
            report_to="none",
            save_strategy="no",
        ),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    trainer.train()
assert trainer.state.global_step == 2
assert trainer.last_credit is not None and trainer.last_credit.replayed.any(), "nothing was replayed"
assert not [m for m in extras if m in sys.modules]
assert not [m for m in sys.modules if m.startswith("trl_mrtpo.scripts")], "the core imported an application"
print("core install OK: two MRTPO steps with a user reward and info block")


def word_steps(completions, **kwargs):  # and a process reward: each word a step
    import re

    texts = [c[-1]["content"] for c in completions]
    return [[(m.start(), m.end(), float(len(m.group()) % 2)) for m in re.finditer(r"\S+", t)] for t in texts]


# the same functions, as a module of the user's that a recipe names by dotted path
USER_MODULE = "import trl_mrtpo\n\n\n" + "\n\n".join(inspect.getsource(f) for f in (says_red, red_block, word_steps))
with tempfile.TemporaryDirectory() as folder:
    root = Path(folder)
    (root / "user_rewards.py").write_text(USER_MODULE)
    build_policy(tokenizer, GymSpec(), seed=0).save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("\n".join(json.dumps({"prompt": p}) for p in prompts * 2))
    recipe = {
        "model_name_or_path": str(root / "model"),
        "dataset_name": str(root / "data"),
        "reward_funcs": ["user_rewards.says_red"],
        "info_blocks": ["user_rewards.red_block"],
        "process_rewards": ["user_rewards.word_steps"],
        "output_dir": str(root / "out"),
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 6,
        "max_steps": 2,
        "credit_warmup_steps": 0,
        "replay_only_varying": False,
        "use_cpu": True,
        "bf16": False,
        "report_to": "none",
        "save_strategy": "no",
        "threads": 1,
    }
    (root / "recipe.yaml").write_text(json.dumps(recipe))  # JSON is YAML
    os.chdir(root)  # the user's module is found from the working directory, as on the command line
    from trl_mrtpo.scripts.train import run

    cli_trainer = run(["--config", str(root / "recipe.yaml")])
    assert cli_trainer.state.global_step == 2 and [
        function_name(f) for f in cli_trainer.credit_terms["process"].process_rewards
    ] == ["word_steps"]
    assert not [m for m in extras if m in sys.modules], "resolving dotted paths imported a kit's extra"
print("core install OK: trl-mrtpo train with a dotted-path reward, info block and process reward")
