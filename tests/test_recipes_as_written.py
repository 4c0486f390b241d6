"""Every recipe in ``recipes/`` trains as written, with only the substitutions a CPU forces, each named here and in
``recipes/README.md``:

1. **model**: a Hub model becomes a tiny random model of the same architecture (Qwen2 for Qwen2.5 and Qwen2.5-Coder,
   Qwen3 for Qwen3-Instruct-2507) with the family's ``tie_word_embeddings``, a vocabulary larger than its tokenizer
   (as Qwen's configs have), saved in the recipe's ``dtype``; its tokenizer carries the family's special tokens as
   added tokens and TRL's shipped chat template for the family, so ``add_response_schema`` and tool parsing attach
   as for the real model. ``embedded`` (SmolLM2-135M-Instruct) and ``embedded-agent`` (it with the agent warm start)
   are the real model and are not substituted; the agent recipe's step must show tool calls, a varying tool-call
   reward and replayed tool rollouts.
2. **data**: Spider, HIR-16K and RLLA (not on PyPI) become small local copies in their real layouts.
3. **vLLM**: TRL's engine becomes the stand-in of ``test_vllm_stand_in.py`` (sampled ids and off-policy log-probs).
4. **steps**: ``max_steps`` is cut to 1 (one optimizer step: a whole generation batch, every accumulation step); 2
   for the agent recipe, whose replayed tool rollouts are checked: its first step is warm-up step 0 (beta 0), which
   replays nothing.
5. **device**: ``use_cpu: true`` (transformers refuses ``bf16`` on a machine without a GPU unless it is set).
6. **4-bit**: the QLoRA recipes run with ``load_in_4bit: false``. Checked first: bitsandbytes 0.50.2's CPU path loads a
   4-bit model and generates, but its training forward fails inside bitsandbytes (``matmul_4bit`` adds the bias in
   place on a tensor autograd tracks: "a view of a leaf Variable that requires grad is being used in an in-place
   operation"), so the adapter trains on the bf16 base here.

Everything else stays as written: dtype and ``bf16``, completion lengths, batch size, G, gradient accumulation,
``steps_per_generation``, LoRA targets, loss, importance-sampling correction, tools, activation checkpointing, the
chat template. The test fails when a recipe gains a field it does not know.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import tiny_model_of
from tests.helpers import template_tokenizer
from tests.test_vllm_stand_in import StandInServer, StandInVLLM

pytestmark = [pytest.mark.slow, pytest.mark.recipes]
RECIPES = sorted(p for p in Path("recipes").glob("*/*.yaml") if p.parent.name != "accelerate")
SUBSTITUTED = {
    "model_name_or_path", "data_path", "data_split_file", "database_dir", "max_steps", "output_dir", "use_cpu",
    "load_in_4bit",
}  # fmt: skip
KEPT = {  # every field a recipe may hold, run as written
    "activation_checkpointing", "adam_beta1", "adam_beta2", "bf16", "bnb_4bit_quant_type", "credit_assignment",
    "credit_beta", "credit_warmup_steps", "data_loader", "datasets", "dtype", "epsilon", "epsilon_high",
    "gradient_accumulation_steps", "info_blocks", "learning_rate", "logging_steps", "lora_alpha",
    "lora_r", "lora_target_modules", "lr_scheduler_type", "max_completion_length", "max_second_moment_ratio",
    "num_generations", "per_device_train_batch_size", "replay_batch_size", "report_to", "reward_funcs",
    "save_steps", "save_strategy", "task", "temperature", "trainer", "use_bnb_nested_quant", "use_peft",
    "use_vllm", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization", "vllm_mode", "vllm_server_host",
    "vllm_server_port", "steps_per_generation", "loss_type", "vllm_importance_sampling_correction",
    "attn_implementation", "max_tool_calling_iterations", "chat_template_path",
}  # fmt: skip
# family -> (architecture, tie_word_embeddings, TRL's chat template, special tokens, eos, pad)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
FAMILIES = {
    "Qwen/Qwen2.5-1.5B-Instruct": ("Qwen2Config", True, "qwen2_5", QWEN_SPECIALS),
    "Qwen/Qwen2.5-3B-Instruct": ("Qwen2Config", True, "qwen2_5", QWEN_SPECIALS),
    "Qwen/Qwen2.5-7B-Instruct": ("Qwen2Config", False, "qwen2_5", QWEN_SPECIALS),
    "Qwen/Qwen2.5-Coder-3B-Instruct": ("Qwen2Config", True, "qwen2_5", QWEN_SPECIALS),
    "Qwen/Qwen2.5-Coder-7B-Instruct": ("Qwen2Config", False, "qwen2_5", QWEN_SPECIALS),
    "Qwen/Qwen3-4B-Instruct-2507": (
        "Qwen3Config", True, "qwen3_instruct_2507",
        [*QWEN_SPECIALS, "<tool_response>", "</tool_response>", "<think>", "</think>"],
    ),
}  # fmt: skip
CORPUS = [
    "Write SQL for the question: SELECT name FROM users WHERE id = 3; count(*) GROUP BY city ORDER BY name.",
    "Describe the sea in three paragraphs, without commas, and end with the phrase: any other questions?",
    'Call the tool get_weather with {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}.',
    "You are a helpful assistant. The user asks; the assistant answers in JSON, markdown or plain text.",
]


def family_tokenizer(family: str):
    """A byte-level BPE of a few hundred tokens with the family's special tokens added and TRL's chat template."""
    _, _, template, specials = FAMILIES[family]
    return template_tokenizer(template, specials, CORPUS, eos="<|im_end|>", pad="<|endoftext|>")


def family_model_dir(family: str, dtype: str, folder: Path) -> str:
    """The tiny random model of ``family`` and its tokenizer, saved in ``dtype``."""
    config_name, tie, _, _ = FAMILIES[family]
    tokenizer = family_tokenizer(family)
    model = tiny_model_of(config_name, tokenizer, tie).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_every_recipe_field_is_one_the_recipe_test_runs():
    """A new field is added to KEPT (run as written) or SUBSTITUTED (with its reason in the module docstring)."""
    for recipe in RECIPES:
        unknown = set(yaml.safe_load(recipe.read_text())) - KEPT - SUBSTITUTED
        assert not unknown, f"{recipe}: fields the recipe test does not know how to run: {sorted(unknown)}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_trains_as_written(recipe, local_data, tmp_path, monkeypatch):
    import trl.trainer.grpo_trainer as grpo

    from trl_mrtpo.scripts.train import build_trainer, make_parser

    config = yaml.safe_load(recipe.read_text())
    family = config["model_name_or_path"]
    steps = "2" if family == "embedded-agent" else "1"
    overrides = ["--output_dir", str(tmp_path / "out"), "--max_steps", steps, "--use_cpu", "true"]
    if family not in ("embedded", "embedded-agent"):
        dtype = config.get("dtype", "float32")
        overrides += ["--model_name_or_path", family_model_dir(family, dtype, tmp_path / "model")]
    if config.get("load_in_4bit"):
        overrides += ["--load_in_4bit", "false"]
    if config.get("data_loader"):
        overrides += ["--data_path", local_data[{"bird": "spider"}.get(config["data_loader"], config["data_loader"])]]
        if config["data_loader"] in ("spider", "bird"):
            overrides += ["--data_split_file", "train_spider.json", "--database_dir", "database"]
    if config.get("use_vllm"):
        StandInVLLM.created.clear()
        monkeypatch.setattr(grpo, "VLLMGeneration", StandInVLLM)
        monkeypatch.setattr(StandInVLLM, "vllm_client", StandInServer(), raising=False)
    parsed = make_parser().parse_args_and_config(["--config", str(recipe), *overrides])
    trainer = build_trainer(*parsed, recipe=str(recipe))
    args = trainer.args
    for key in ("per_device_train_batch_size", "num_generations", "max_completion_length", "temperature"):
        if key in config:
            assert getattr(args, key) == config[key], key
    assert args.gradient_accumulation_steps == config.get("gradient_accumulation_steps", 1)
    assert args.bf16 == config.get("bf16", False)
    if family not in ("embedded", "embedded-agent"):
        dtype = getattr(torch, config.get("dtype", "float32"))
        assert any(p.dtype == dtype for p in trainer.model.parameters())
    if config.get("trainer") == "opsd":
        trainer.train()
        return
    batches = []
    original = trainer._generate_and_score_completions
    monkeypatch.setattr(
        trainer, "_generate_and_score_completions", lambda inputs: batches.append(original(inputs)) or batches[-1]
    )
    trainer.train()
    assert batches, "no generation batch"
    for batch in batches:
        advantages, mask = batch["advantages"], batch["completion_mask"]
        assert advantages.shape == mask.shape and torch.isfinite(advantages).all()
        assert batch["completion_ids"].shape[1] <= config["max_completion_length"]
    if config.get("use_vllm"):
        (engine,) = StandInVLLM.created
        assert engine.synced >= 1
    json.dumps(trainer.state.log_history)  # logged metrics are plain numbers
    if family == "embedded-agent":  # the warm start calls the tools: the agent recipe has something to credit
        logged = trainer.state.log_history[0]
        credit = trainer.last_credit
        calls = credit.rewards[:, trainer.reward_func_names.index("agent_call_reward")]
        assert logged["tools/call_frequency"] > 0, logged
        assert len(set(calls.tolist())) > 1, calls  # the tool-call reward varies
        assert credit.replayed.any(), "no tool rollout was replayed"
