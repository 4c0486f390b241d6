"""Bad configurations, recipes, templates and command lines: a configuration value or type the fields refuse; a chat
template that is missing, empty or does not parse, refused at start-up naming the file and the option; a recipe's
mistakes are the usage line with exit status 2 before the model loads; ``inspect --config`` sees the recipe's
settings, template and tools; a count flag below its minimum; the demo's and the plot callback's inputs; an fp16
overflow named as one."""

import pytest
import torch

from tests.helpers import make_args
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.chat_templates import chat_template
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.scripts.cli import main

NAN, INF = float("nan"), float("inf")


VALID = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


def test_a_template_file_that_is_empty_or_does_not_parse_is_refused_naming_it(tmp_path):
    empty, broken = tmp_path / "empty.jinja", tmp_path / "broken.jinja"
    empty.write_text("  \n")
    broken.write_text("{% for m in messages %}{{ m['content'] }}")  # no endfor
    with pytest.raises(ValueError, match=rf"chat_template_path='{empty}' \({empty}\) is empty"):
        chat_template(str(empty))
    with pytest.raises(
        ValueError, match=rf"chat_template_path='{broken}' \({broken}\) does not parse as a Jinja template"
    ):
        chat_template(str(broken))


def test_a_valid_template_of_any_file_name_is_accepted(tmp_path):
    for name in ("mine.j2", "mine.jinja2", "template.txt"):
        path = tmp_path / name
        path.write_text(VALID)
        assert chat_template(str(path)) == VALID


def test_a_missing_path_is_refused_without_listing_the_users_folder_as_trls(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # the unknown name is not looked up
    (tmp_path / "mine.jinja").write_text(VALID)  # the user's own folder holds a template
    for missing in (tmp_path / "other", tmp_path / "other.jinja"):
        with pytest.raises(ValueError) as error:
            chat_template(str(missing))
        assert "no such file" in str(error.value) and "mine" not in str(error.value), str(error.value)
    with pytest.raises(ValueError, match=r"neither a template file, a template TRL ships \(.*qwen3.*\) nor"):
        chat_template("no-such-template-name")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--task", "nope"], "task='nope' is unknown; choose one of basic, sql"),
        (["--task", "basic", "--chat_template_path", "/no/such/template.jinja"], "no such file"),
        (["--task", "basic", "--credit_assignment", "joint"], "belong to the research room: add `trainer: research`"),
    ],
    ids=["unknown-task", "missing-template", "research-only-rule"],
)
def test_a_train_refusal_is_the_usage_line_with_exit_2_before_the_model_loads(tmp_path, capsys, flags, named):
    """The model path does not exist: a refusal that came after loading would be a traceback, not exit status 2."""
    argv = [
        "train",
        "--model_name_or_path",
        str(tmp_path / "no-model"),
        "--output_dir",
        str(tmp_path),
        "--use_cpu",
        "true",
        *flags,
    ]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: trl-mrtpo train") and named in err, err


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--reward_funcs", "no_such_module.reward"], "no_such_module"),
        (["--task", "basic", "--info_blocks", "nope_block"], "unknown info_block 'nope_block'"),
        (["--task", "basic", "--info_blocks", "none", "none"], "info_blocks has 2 entries but there are 4 reward"),
        (
            [
                "--task",
                "sql",
                "--data_loader",
                "spider",
                "--data_path",
                "/no/such/spider",
                "--data_split_file",
                "/no/such/train.json",
            ],
            "/no/such/",
        ),
        (["--task", "basic", "--model_name_or_path", "./no/such/model"], "'./no/such/model' is a path, and no such"),
        (["--config", "BROKEN_YAML"], "the recipe is not valid YAML: while parsing a flow sequence"),
    ],
    ids=["reward-path", "unknown-block", "block-count", "data-file", "model-folder", "yaml-syntax"],
)
def test_recipe_mistakes_found_before_the_model_loads_end_in_the_usage_line(tmp_path, capsys, flags, named):
    """What a recipe names is resolved before the model loads (its rewards, blocks, data and model folder), so each
    mistake is the usage line and exit status 2, naming it, as a bad flag is."""
    broken = tmp_path / "broken.yaml"
    broken.write_text("task: basic\nreward_funcs: [a, b\n")
    flags = [str(broken) if flag == "BROKEN_YAML" else flag for flag in flags]
    model = [] if "--model_name_or_path" in flags else ["--model_name_or_path", "embedded"]
    with pytest.raises(SystemExit) as exit_:
        main(["train", *model, "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", *flags])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("usage: trl-mrtpo train") and named in err, err


def test_demo_refuses_zero_steps(capsys):
    from trl_mrtpo.scripts.demo import run_demo

    with pytest.raises(ValueError, match="run_demo: steps must be an integer >= 1, got 0"):
        run_demo(steps=0)
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--steps", "0"])
    assert exit_.value.code == 2 and "argument --steps: must be an integer >= 1" in capsys.readouterr().err


def test_fp16_logits_that_overflow_are_named_as_overflow(tiny_tokenizer, tmp_path):
    from tests.conftest import build_tiny_model
    from tests.helpers import make_args

    model = build_tiny_model(tiny_tokenizer).to(torch.float16)
    with torch.no_grad():
        model.model.norm.weight.fill_(3000.0)
        model.lm_head.weight.mul_(100.0)  # logits past fp16's 65,504
    with pytest.raises(ValueError, match=r"The logits of LlamaForCausalLM overflow torch.float16 \(inf or NaN"):
        MRTPOTrainer(
            model=model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )


def test_inspect_config_uses_the_recipes_chat_template_environment_and_tools(tmp_path, monkeypatch):
    """The agent recipe, on a tiny model of a tool-calling family: ``inspect --config`` builds the trainer with the
    recipe's chat template (TRL's qwen3) and the task's environment, whose methods are the tools."""
    import trl

    from tests.test_recipes_as_written import family_model_dir

    model_dir = family_model_dir("Qwen/Qwen3-4B-Instruct-2507", "float32", tmp_path / "model")
    recipe = tmp_path / "agent.yaml"
    text = open("recipes/cpu/agent-smollm2.yaml").read().replace("model_name_or_path: embedded-agent\n", "")
    recipe.write_text(f"model_name_or_path: {model_dir}\n{text}")
    seen = []
    import trl_mrtpo.scripts.inspection as inspection

    sample_credit = inspection.sample_credit

    def recording(trainer, rows, num_generations):
        seen.append((trainer.environment_factories, list(trainer.tools or []), trainer.processing_class.chat_template))
        return sample_credit(trainer, rows, num_generations)

    monkeypatch.setattr(inspection, "sample_credit", recording)
    main(["inspect", "--config", str(recipe), "--num-prompts", "1", "--num-generations", "2", "--max-new-tokens", "8",
          "--output", str(tmp_path / "credit.html"), "--threads", "1"])  # fmt: skip
    (environments, tools, template) = seen[0]
    assert environments and tools, (environments, tools)
    assert template == open(f"{trl.__path__[0]}/chat_templates/qwen3.jinja").read()
    assert (tmp_path / "credit.html").is_file()


# ---------------------------------------------------------------- configuration: refused by name, with the range
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("credit_beta", NAN, "credit_beta must be a finite number"),
        ("credit_beta", INF, "credit_beta must be a finite number"),
        ("credit_beta", -0.1, r"credit_beta must be in \[0, 1\]"),
        ("credit_beta", 1.5, r"credit_beta must be in \[0, 1\]"),
        ("credit_warmup_steps", NAN, "credit_warmup_steps must be a finite number, got nan"),
        ("credit_warmup_steps", -1, "credit_warmup_steps must be >= 0"),
        ("credit_warmup_steps", 2.5, "credit_warmup_steps must be a whole number of steps, or a share of max_steps"),
        ("max_second_moment_ratio", NAN, "max_second_moment_ratio must be a finite number"),
        ("max_second_moment_ratio", INF, "max_second_moment_ratio must be a finite number"),
        ("max_second_moment_ratio", 0.5, "max_second_moment_ratio must be >= 1"),
        ("cort_eta", NAN, "cort_eta must be a finite number"),
        ("cort_eta", 2.0, r"cort_eta must be in \[0, 2\)"),
        ("cort_tau", NAN, "cort_tau must be a finite number"),
        ("cort_offset", -INF, "cort_offset must be a finite number"),
        ("concur_pass_threshold", NAN, "concur_pass_threshold must be a finite number"),
        ("concur_ceiling", INF, "concur_ceiling must be a finite number"),
        ("concur_min_readings", 1, "concur_min_readings must be >= 2"),
        ("taco_strength", NAN, "taco_strength must be a finite number"),
        ("taco_strength", 1.5, r"taco_strength must be in \[0, 1\]"),
        ("taco_threshold", NAN, "taco_threshold must be a finite number"),
        ("taco_sharpness", INF, "taco_sharpness must be a finite number"),
        ("reward_strength_floor", NAN, "reward_strength_floor must be a finite number"),
        ("reward_strength_floor", 0.6, r"reward_strength_floor must be in \(0, 0.5\]"),
        ("temperature", NAN, "temperature must be a finite number"),
        ("reward_weights", [1.0, NAN], r"reward_weights\[1\] must be a finite number"),
        ("reward_weights", [INF, 1.0], r"reward_weights\[0\] must be a finite number"),
        ("reward_weights", [1e39], r"reward_weights\[0\]=1e\+39 is beyond float32's range"),
        ("reward_weighting", "mean", "reward_weighting='mean' is unknown"),
        ("concur_ceiling_mode", "soft", "concur_ceiling_mode must be one of"),
        ("replay_batch_size", 0, "replay_batch_size must be >= 1"),
        ("replay_chunk_size", 0, "replay_chunk_size must be >= 1 or None"),
        ("replay_min_shared_prefix", 0, "replay_min_shared_prefix must be >= 1 or None"),
        ("divergence_backend", "cuda", "divergence_backend must be one of"),
        ("collapse_warning_steps", -1, "collapse_warning_steps must be >= 0"),
    ],
)
def test_config_refuses(tmp_path, field, value, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make_args(tmp_path, **{field: value})


# ---------------------------------------------------------------- options where they do nothing
@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(credit_assignment="grpo", preserve_reward_totals=True), "preserve_reward_totals=True has no effect"),
        (dict(credit_assignment="cort", preserve_reward_totals=True), "preserve_reward_totals=True has no effect"),
        (dict(credit_assignment="mrtpo", cort_eta=0.5), "cort_eta=0.5 has no effect unless credit_assignment='cort'"),
        (dict(concur_ceiling=0.5), "concur_ceiling=0.5 has no effect unless reward_weighting='concur'"),
        (dict(taco_threshold=2.0), "taco_threshold=2.0 has no effect unless taco_strength > 0"),
    ],
)
def test_an_option_that_would_do_nothing_is_refused(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **fields)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(credit_assignment="token"), "credit_assignment='token' is unknown"),
        (
            dict(credit_assignment="joint", reward_strength_floor=0.3),
            "reward_strength_floor=0.3 has no effect unless credit_assignment is one of mrtpo, shuffled",
        ),
    ],
)
def test_what_a_configuration_asks_of_its_rule_is_refused_where_the_rule_is_resolved(tmp_path, fields, message):
    """The configuration checks ranges and types only; the rule's name and what depends on the rule are checked
    where the trainer (or the command) resolves it, before the model loads."""
    from trl_mrtpo.checks.inputs import check_credit_settings
    from trl_mrtpo.rules import resolve_credit_rule

    args = make_args(tmp_path, **fields)
    with pytest.raises(ValueError, match=message):
        check_credit_settings(args, resolve_credit_rule(args))


# ---------------------------------------------------------------- config field types: Python, command line, YAML
@pytest.mark.parametrize(
    "field, value, message",
    [
        ("reward_weights", 1.0, "reward_weights must be list\\[float\\] \\| None, got float 1.0"),
        ("process_reward_weights", "1", "process_reward_weights must be list\\[float\\] \\| None, got str"),
        ("credit_beta", "0.5", "credit_beta must be float, got str '0.5'"),
        ("credit_warmup_steps", "10", "credit_warmup_steps must be float, got str '10'"),
        ("info_block_separator", None, "info_block_separator must be str, got NoneType"),
        ("replay_only_varying", "yes", "replay_only_varying must be bool, got str"),
    ],
)
def test_a_config_field_of_the_wrong_type_is_named(tmp_path, field, value, message):
    with pytest.raises(TypeError, match=message):
        make_args(tmp_path, **{field: value})


@pytest.mark.parametrize(
    "recipe, extra, error, message",
    [
        ("reward_weights: [1.0, null]\n", [], TypeError, "reward_weights must be list\\[float\\] \\| None, got list"),
        ("reward_funcs: my_pkg.rewards.fn\n", [], TypeError, "reward_funcs must be list\\[str\\] \\| None, got str"),
        ("info_block_separator: null\n", [], TypeError, "info_block_separator must be str, got NoneType"),
        ("num_prompts: 0\n", [], ValueError, "num_prompts must be >= 1, got 0"),
        ("", ["--num_prompts", "-3"], ValueError, "num_prompts must be >= 1, got -3"),
    ],
)
def test_a_recipe_or_command_line_of_the_wrong_type_is_named(tmp_path, recipe, extra, error, message):
    from trl_mrtpo.scripts.train import make_parser

    path = tmp_path / "recipe.yaml"
    path.write_text(f"task: basic\nuse_cpu: true\nbf16: false\noutput_dir: {tmp_path}\n{recipe}")
    with pytest.raises(error, match=message):
        make_parser().parse_args_and_config(["--config", str(path), *extra])


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("credit_beta", 10**400, "credit_beta must be a finite number"),
        ("max_second_moment_ratio", -(10**400), "max_second_moment_ratio must be a finite number"),
        ("reward_weights", [1.0, 10**400], "reward_weights\\[1\\] must be a finite number"),
    ],
)
def test_an_integer_too_large_for_any_float_is_named(tmp_path, field, value, message):
    """An int beyond any float (10**400) in a configuration field: a named ValueError, not a bare OverflowError."""
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **{field: value})


def test_the_train_command_refuses_a_bad_value_with_its_message_not_a_traceback(capsys):
    """``trl-mrtpo train`` with a value a configuration refuses (an unknown credit rule, a beta out of range): the
    message, after the usage line, exit status 2, as argparse refuses a flag, before the model loads; not a
    traceback. A rule's import path that does not import is refused alike."""
    from trl_mrtpo.scripts.cli import main

    for flag, value, message in [
        ("--credit_assignment", "mrtop", "credit_assignment='mrtop' is unknown; choose one of mrtpo, gdpo, grpo"),
        ("--credit_assignment", "no_such_pkg.Rule", "cannot import credit rule 'no_such_pkg.Rule'"),
        ("--credit_beta", "2", "credit_beta must be in [0, 1], got 2.0."),
    ]:
        with pytest.raises(SystemExit) as stopped:
            main(["train", "--config", "recipes/cpu/basic-smollm2.yaml", flag, value])
        assert stopped.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("usage: trl-mrtpo train") and f"error: {message}" in err


# every count flag of the CLI's verbs: a value below its minimum is refused by argparse, naming the flag (`demo
# --steps 0` trained one step and saved an adapter; `--steps -1` trained 12)
COUNT_FLAGS = [
    (["demo", "--steps", "0"], "--steps", ">= 1"),
    (["demo", "--steps", "-1"], "--steps", ">= 1"),
    (["demo", "--prompts-per-step", "0"], "--prompts-per-step", ">= 1"),
    (["demo", "--max-completion-length", "0"], "--max-completion-length", ">= 1"),
    (["demo", "--num-generations", "1"], "--num-generations", ">= 2"),
    (["demo", "--warmup-steps", "-3"], "--warmup-steps", ">= 0"),
    (["demo", "--threads", "0"], "--threads", ">= 1"),
    (["inspect", "--num-prompts", "0"], "--num-prompts", ">= 1"),
    (["inspect", "--num-generations", "0"], "--num-generations", ">= 2"),
    (["inspect", "--max-new-tokens", "0"], "--max-new-tokens", ">= 1"),
    (["eval", "--limit", "0"], "--limit", ">= 1"),
    (["eval", "--batch-size", "2.5"], "--batch-size", ">= 1"),
    (["gym", "--jobs", "0"], "--jobs", ">= 1"),
]


@pytest.mark.parametrize("argv,flag,minimum", COUNT_FLAGS, ids=[" ".join(a) for a, _, _ in COUNT_FLAGS])
def test_a_count_flag_below_its_minimum_is_refused_naming_the_flag(argv, flag, minimum, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {flag}: must be an integer {minimum}, got {argv[-1]!r}" in error, error


@pytest.mark.parametrize("names", ["alt", ["alt", 3], [None]])
def test_credit_plot_callback_takes_a_list_of_names(names):
    """A string plotted one reward per character ('a', 'l', 't')."""
    from trl_mrtpo.observability.callbacks import CreditPlotCallback

    with pytest.raises(TypeError, match="takes a list of reward names"):
        CreditPlotCallback(reward_names=names)


@pytest.mark.parametrize(
    "names,history,said",
    [
        (["alt"], [{"rewards/a/mean": 1.0, "mrtpo/beta": 0.5}], "no reward named 'alt' was logged (logged: a)"),
        (None, [{"rewards/a/mean": 1.0, "loss": 0.1}], "logged no MRTPO credit metrics (a `grpo` run"),
    ],
    ids=["unknown reward", "grpo run"],
)
def test_credit_plot_callback_says_why_it_wrote_no_picture(names, history, said, tmp_path, caplog):
    from types import SimpleNamespace

    from trl_mrtpo.observability.callbacks import CreditPlotCallback

    state = SimpleNamespace(is_world_process_zero=True, log_history=history)
    args = SimpleNamespace(output_dir=str(tmp_path), credit_warmup_steps=0)
    with caplog.at_level("WARNING"):
        CreditPlotCallback(reward_names=names).on_train_end(args, state, None)
    assert said in caplog.text and not (tmp_path / "mrtpo_curves.png").exists()


@pytest.mark.parametrize("kind", ["encoder", "classifier"])
def test_demo_refuses_a_checkpoint_that_is_not_a_causal_lm(kind, tmp_path, tiny_tokenizer):
    """``demo --model`` on an encoder or a classifier checkpoint never said it was not a causal LM."""
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForSequenceClassification

    from trl_mrtpo.scripts.demo import check_causal_lm

    if kind == "encoder":
        model = BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    else:
        config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)  # fmt: skip
        model = LlamaForSequenceClassification(config)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"--model .* not a causal language model"):
        check_causal_lm(str(tmp_path))


class _Inspected(Exception):
    """Raised by the patched ``sample_credit``: what ``inspect`` would have scored with, without scoring."""

    def __init__(self, trainer):
        self.trainer = trainer


def says_red_process(prompts, completions, **kwargs):  # a process reward a recipe names by dotted path
    return [[(len(c), 1.0)] for c in completions]


# item 5: each field of a recipe inspect used to ignore, and what the trainer it builds must then hold
RECIPE_FIELDS = [
    ("info_block_separator", 'info_block_separator: "\\n--\\n"\n', lambda t: t.args.info_block_separator == "\n--\n"),
    ("reward_weights", "reward_weights: [2.0, 0.5]\n", lambda t: list(t.args.reward_weights) == [2.0, 0.5]),
    ("credit_beta", "credit_beta: 0.2\n", lambda t: t.args.credit_beta == 0.2),
    ("temperature", "temperature: 0.7\n", lambda t: t.args.temperature == 0.7),
    (
        "process_rewards",
        "process_rewards: [tests.test_bad_recipes_and_templates.says_red_process]\n",
        lambda t: [f.__name__ for f in t.credit_terms["process"].process_rewards] == ["says_red_process"],
    ),
    (
        "trainer: research",
        "trainer: research\ncredit_assignment: joint\n",
        lambda t: type(t).__name__ == "ResearchTrainer" and t.args.credit_assignment == "joint",
    ),
]


def _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, extra: str, model: bool = True, argv=()):
    import json

    from tests.conftest import build_tiny_model

    model_dir = tmp_path / "tiny"
    build_tiny_model(tiny_tokenizer).save_pretrained(model_dir)
    tiny_tokenizer.save_pretrained(model_dir)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"Name a colour {i}."}) for i in range(2)))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        (f"model_name_or_path: {model_dir}\n" if model else "")
        + "reward_funcs: [tests.test_inspection.says_red, trl_mrtpo.kits.basic.lowercase_reward]\n"
        + "info_blocks: [tests.test_inspection.red_block, none]\n"
        + f"datasets:\n  - path: json\n    data_files: {data}\n    split: train\n"
        + extra
    )

    import trl_mrtpo.scripts.inspection as inspection

    def inspected(trainer, rows, num_generations):
        raise _Inspected(trainer)

    monkeypatch.setattr(inspection, "sample_credit", inspected)
    with pytest.raises(_Inspected) as caught:
        main(["inspect", "--config", str(recipe), "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens",
              "4", "--output", str(tmp_path / "credit.html"), "--threads", "1", *argv])  # fmt: skip
    return caught.value.trainer, model_dir


@pytest.mark.parametrize("field,line,holds", RECIPE_FIELDS, ids=[f for f, _, _ in RECIPE_FIELDS])
def test_inspect_config_scores_with_the_recipes_credit_settings(
    field, line, holds, tmp_path, tiny_tokenizer, monkeypatch
):
    trainer, _ = _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, line)
    assert holds(trainer), field


def test_inspect_config_flags_given_win_over_the_recipe(tmp_path, tiny_tokenizer, monkeypatch):
    trainer, _ = _inspect_recipe(
        tmp_path,
        tiny_tokenizer,
        monkeypatch,
        "credit_beta: 0.2\ntemperature: 0.7\n",
        argv=["--beta", "0.9", "--temperature", "1.3"],
    )
    assert (trainer.args.credit_beta, trainer.args.temperature) == (0.9, 1.3)


def test_inspect_config_applies_the_adapter_beside_it(tmp_path, tiny_tokenizer, monkeypatch):
    from peft import LoraConfig, get_peft_model

    from tests.conftest import build_tiny_model

    adapter = tmp_path / "adapter"
    get_peft_model(build_tiny_model(tiny_tokenizer), LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        adapter
    )
    tiny_tokenizer.save_pretrained(adapter)
    trainer, _ = _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, "", argv=["--adapter", str(adapter)])
    assert any("lora_A" in name for name, _ in trainer.model.named_parameters())


def test_inspect_config_without_a_model_is_refused_as_train_refuses_it(tmp_path, tiny_tokenizer, monkeypatch, capsys):
    with pytest.raises(SystemExit) as stopped:
        _inspect_recipe(tmp_path, tiny_tokenizer, monkeypatch, "", model=False)
    assert stopped.value.code == 2 and "model_name_or_path is required" in capsys.readouterr().err


def test_model_embedded_in_python_is_refused_naming_the_function(tmp_path):
    """``model="embedded"`` is the command's name; from Python it failed with the Hub's OSError after a lookup."""
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    with pytest.raises(ValueError, match=r"embedded_model_path\(\)"):
        MRTPOTrainer(
            model="embedded",
            reward_funcs=BASIC.rewards,
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(4),
        )
