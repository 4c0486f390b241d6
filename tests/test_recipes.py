"""Every recipe parses and builds an MRTPOTrainer (the model swapped for the tiny one, data for small local copies)."""

from pathlib import Path

import pytest

from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.scripts.train import build_trainer, make_parser

RECIPES = sorted(p for p in Path("recipes").glob("*/*.yaml") if p.parent.name != "accelerate")


def test_recipes_exist_for_every_task_and_paper_model():
    names = {f"{p.parent.name}/{p.stem}" for p in RECIPES}
    for expected in [
        "sql/qwen2.5-coder-3b-instruct",
        "sql/qwen2.5-coder-7b-instruct-lora",
        "if/qwen3-4b-instruct-2507",
        "if/qwen2.5-7b-instruct-lora",
        "tools/qwen2.5-1.5b-instruct",
        "tools/qwen2.5-3b-instruct-lora",
        "cpu/sql-smollm2",
        "vllm/tools-qwen2.5-1.5b-server",
        *(f"opsd/{task}-smollm2" for task in ("basic", "if", "sql", "tools", "short")),
    ]:
        assert expected in names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_recipe_builds_a_trainer(recipe, tiny_dir, local_data, tmp_path):
    import yaml

    config = yaml.safe_load(recipe.read_text())
    overrides = ["--model_name_or_path", tiny_dir, "--output_dir", str(tmp_path), "--use_cpu", "true"]
    overrides += ["--bf16", "false", "--use_vllm", "false", "--activation_checkpointing", "false"]
    overrides += ["--dtype", "float32"]
    overrides += ["--load_in_4bit", "false"]  # bitsandbytes needs a GPU
    if config.get("data_loader"):
        overrides += ["--data_path", local_data[{"bird": "spider"}.get(config["data_loader"], config["data_loader"])]]
    script_args, training_args, model_args, dataset_args = make_parser().parse_args_and_config(
        ["--config", str(recipe), *overrides]
    )
    trainer = build_trainer(script_args, training_args, model_args, dataset_args)
    if config.get("trainer") == "opsd":  # the comparison arm: TRL's SDFT trainer, the blocks as privileged context
        from trl.experimental.sdft import SDFTTrainer

        assert isinstance(trainer, SDFTTrainer) and not isinstance(trainer, MRTPOTrainer)
        assert trainer.args.teacher_model_kind == "live" and trainer.args.max_steps == config["max_steps"]
        assert trainer.args.num_generations == config["num_generations"] and len(trainer.scoring_funcs) >= 2
        assert any(trainer.train_dataset["privileged_context"])
        return
    assert isinstance(trainer, MRTPOTrainer)
    # every key of the recipe that is a training field arrives as written (the overrides above aside)
    overridden = {"output_dir", "use_cpu", "bf16", "use_vllm", "activation_checkpointing"}
    compared = 0
    for key, value in config.items():
        if key in overridden or not hasattr(training_args, key):
            continue
        got = getattr(training_args, key)
        got = got.value if hasattr(got, "value") else got  # enums such as lr_scheduler_type
        if key == "report_to" and value == "none":
            value = []  # transformers' spelling of "no reporting"
        assert got == value or str(got) == str(value), (key, got, value)
        compared += 1
    assert compared >= 5
    assert trainer.num_generations == config["num_generations"]
    assert len(trainer.reward_funcs) == len(trainer.info_block_builders) >= 2
    assert len(trainer.train_dataset) > 0
    if config.get("use_peft"):
        assert hasattr(trainer.model, "peft_config")


class _Recorded:
    """Stands in for MRTPOTrainer: keeps what build_trainer passes (no model is loaded)."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _built(monkeypatch, argv):
    import trl_mrtpo.trainer

    monkeypatch.setattr(trl_mrtpo.trainer, "MRTPOTrainer", _Recorded)
    return build_trainer(*make_parser().parse_args_and_config(argv)).kwargs


def test_train_forwards_model_options_and_quantization(monkeypatch, tmp_path):
    from transformers import BitsAndBytesConfig

    kwargs = _built(
        monkeypatch,
        ["--config", "recipes/cpu/basic-smollm2.yaml", "--model_name_or_path", "some/model",
         "--output_dir", str(tmp_path), "--load_in_4bit", "true", "--bnb_4bit_quant_type", "nf4",
         "--attn_implementation", "sdpa", "--model_revision", "v2", "--trust_remote_code", "true",
         "--dtype", "bfloat16"],
    )  # fmt: skip
    assert kwargs["model"] == "some/model"
    init = kwargs["args"].model_init_kwargs
    assert init["revision"] == "v2" and init["attn_implementation"] == "sdpa"
    assert init["dtype"] == "bfloat16" and init["trust_remote_code"] is True
    quantization = kwargs["quantization_config"]
    assert isinstance(quantization, BitsAndBytesConfig)
    assert quantization.load_in_4bit and quantization.bnb_4bit_quant_type == "nf4"
    assert kwargs["peft_config"].r == 8  # the recipe's LoRA
    assert kwargs["eval_dataset"] is None  # eval_strategy "no": no eval split is built


def test_recipe_model_init_kwargs_win_over_script_defaults(monkeypatch, tmp_path):
    kwargs = _built(
        monkeypatch,
        ["--config", "recipes/cpu/basic-smollm2.yaml", "--model_name_or_path", "some/model",
         "--output_dir", str(tmp_path), "--model_init_kwargs", '{"dtype": "float16"}'],
    )  # fmt: skip
    assert kwargs["args"].model_init_kwargs["dtype"] == "float16" and kwargs["quantization_config"] is None


def test_train_builds_an_eval_split_when_evaluation_is_on(monkeypatch, tmp_path):
    kwargs = _built(
        monkeypatch,
        ["--config", "recipes/cpu/basic-smollm2.yaml", "--model_name_or_path", "some/model",
         "--output_dir", str(tmp_path), "--eval_strategy", "steps", "--eval_steps", "5", "--num_prompts", "40"],
    )  # fmt: skip
    assert len(kwargs["eval_dataset"]) == 4 and len(kwargs["train_dataset"]) == 36
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text('{"prompt": "hi"}\n{"prompt": "there"}\n')  # one split: train
    argv = ["--model_name_or_path", "some/model", "--output_dir", str(tmp_path), "--task", "basic", "--use_cpu",
            "true", "--bf16", "false", "--eval_strategy", "steps", "--eval_steps", "5",
            "--dataset_name", str(tmp_path / "data")]  # fmt: skip
    with pytest.raises(ValueError, match="no split 'test'"):
        _built(monkeypatch, argv)


def test_train_reads_a_dataset_mixture(monkeypatch, tmp_path):
    kwargs = _built(
        monkeypatch,
        ["--config", "recipes/cpu/own-rewards-smollm2.yaml", "--model_name_or_path", "some/model",
         "--output_dir", str(tmp_path)],
    )  # fmt: skip
    assert len(kwargs["train_dataset"]) == 8 and {"reference", "schema"} <= set(kwargs["train_dataset"].column_names)
    assert [f.__name__ for f in kwargs["reward_funcs"]] == [
        "json_schema_reward", "answer_matches_reference", "length_reward"
    ]  # fmt: skip
    assert kwargs["info_blocks"][2] is None


def test_train_launches_under_trls_accelerate_configs(monkeypatch):
    import accelerate.commands.launch

    import trl_mrtpo.scripts.train
    from trl_mrtpo.scripts.cli import main

    launched = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launched.append)
    main(["train", "--accelerate_config", "zero3", "--config", "recipes/cpu/basic-smollm2.yaml", "--max_steps", "2"])
    (args,) = launched
    assert args.config_file.endswith("trl/accelerate_configs/zero3.yaml")
    assert args.training_script == trl_mrtpo.scripts.train.__file__
    assert args.training_script_args == ["--config", "recipes/cpu/basic-smollm2.yaml", "--max_steps", "2"]
    with pytest.raises(ValueError, match="neither a file nor a valid config"):
        main(["train", "--accelerate_config", "zero9", "--config", "recipes/cpu/basic-smollm2.yaml"])


@pytest.mark.parametrize("task", ["sql", "if", "tools"])
def test_each_paper_task_has_the_single_gpu_and_vllm_lora_recipes(task):
    import yaml

    (single,) = [p for p in RECIPES if p.parent.name == task and p.stem.endswith("-24gb")]
    (colocate,) = [p for p in RECIPES if p.parent.name == "vllm" and p.stem.startswith(f"{task}-")
                   and p.stem.endswith("-lora-colocate")]  # fmt: skip
    single_config, colocate_config = yaml.safe_load(single.read_text()), yaml.safe_load(colocate.read_text())
    assert single_config["use_peft"] and single_config["activation_checkpointing"]
    assert single_config.get("load_in_4bit", False) == ("7b" in single.stem)  # QLoRA for the 7B models
    assert "Memory" in single.read_text() and "--accelerate_config single_gpu" in single.read_text()
    assert colocate_config["use_peft"] and colocate_config["use_vllm"] and colocate_config["vllm_mode"] == "colocate"
    assert colocate_config["task"] == task


def test_ignore_bias_buffers_takes_effect(monkeypatch, tmp_path):
    import torch

    import trl_mrtpo.trainer

    class WithBuffers(_Recorded):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.model = torch.nn.Module()
            self.model.register_buffer("causal_mask", torch.ones(2, 2, dtype=torch.bool))
            self.model.register_buffer("inv_freq", torch.ones(2))

    monkeypatch.setattr(trl_mrtpo.trainer, "MRTPOTrainer", WithBuffers)
    argv = ["--config", "recipes/cpu/basic-smollm2.yaml", "--model_name_or_path", "some/model", "--output_dir",
            str(tmp_path)]  # fmt: skip
    assert not hasattr(
        build_trainer(*make_parser().parse_args_and_config(argv)).model, "_ddp_params_and_buffers_to_ignore"
    )
    trainer = build_trainer(*make_parser().parse_args_and_config([*argv, "--ignore_bias_buffers", "true"]))
    assert trainer.model._ddp_params_and_buffers_to_ignore == ["causal_mask"]


def test_train_passes_the_kits_failure_boundaries_and_process_rewards(monkeypatch, tmp_path):
    from trl_mrtpo.kits.tool_calling import tool_call_boundary

    base = [
        "--config",
        "recipes/cpu/basic-smollm2.yaml",
        "--model_name_or_path",
        "some/model",
        "--output_dir",
        str(tmp_path),
        "--task",
        "tools",
    ]
    kwargs = _built(monkeypatch, base)
    assert kwargs["failure_boundaries"] is None and kwargs["process_rewards"] is None
    process = "trl_mrtpo.gym.task.oracle_process_reward"  # a factory: called with no argument it would fail
    kwargs = _built(monkeypatch, [*base, "--failure_masking", "true", "--process_rewards", "tests.helpers.word_steps"])
    assert kwargs["failure_boundaries"] == [None, tool_call_boundary]
    assert [p.__name__ for p in kwargs["process_rewards"]] == ["word_steps"]
    with pytest.raises(ValueError, match="failure_masking uses a task kit's failure boundaries"):
        _built(monkeypatch, [*base[:-1], "basic", "--failure_masking", "true"])
    with pytest.raises(ValueError, match="cannot import process reward"):
        _built(monkeypatch, [*base, "--process_rewards", process + "_missing"])


def test_resolving_a_dotted_path_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    import sys

    from trl_mrtpo.kits import resolve

    (tmp_path / "my_rewards.py").write_text("def mine(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    assert resolve("my_rewards.mine", "reward").__name__ == "mine"  # found in the working directory
    assert sys.path == before


def test_chat_template_path_takes_a_shipped_name_a_file_or_a_tokenizer(tmp_path, tiny_dir, monkeypatch):
    import huggingface_hub.constants

    from tests.conftest import CHAT_TEMPLATE

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the unknown name is not looked up
    from trl_mrtpo.chat_templates import chat_template

    assert "<tool_call>" in chat_template("qwen3")  # trl/chat_templates/qwen3.jinja
    own = tmp_path / "own.jinja"
    own.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template(str(own)) == own.read_text()
    assert chat_template(tiny_dir) == CHAT_TEMPLATE
    with pytest.raises(ValueError, match="chat_template_path='no-such-template' is neither"):
        chat_template("no-such-template")


def test_chat_template_path_is_refused_for_the_opsd_arm(tmp_path, tiny_dir, local_data):
    """The OPSD arm loads its own tokenizer: a template given for it would be dropped without a word."""
    argv = ["--config", "recipes/opsd/basic-smollm2.yaml", "--model_name_or_path", tiny_dir,
            "--output_dir", str(tmp_path), "--chat_template_path", "qwen3"]  # fmt: skip
    with pytest.raises(ValueError, match="chat_template_path is not passed to the OPSD arm"):
        build_trainer(*make_parser().parse_args_and_config(argv))
