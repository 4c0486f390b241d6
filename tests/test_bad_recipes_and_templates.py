"""Bad recipes and templates: a chat template that is missing, empty or does not parse is refused at start-up naming
the file and the option; a recipe's mistakes are the usage line with exit status 2 before the model loads;
``inspect --config`` sees the recipe's template and tools; an fp16 overflow is named as one."""

import pytest
import torch

from trl_mrtpo.scripts.cli import main
from trl_mrtpo.scripts.train import chat_template

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
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

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
    from trl_mrtpo.trainer import MRTPOTrainer

    model_dir = family_model_dir("Qwen/Qwen3-4B-Instruct-2507", "float32", tmp_path / "model")
    recipe = tmp_path / "agent.yaml"
    text = open("recipes/cpu/agent-smollm2.yaml").read().replace("model_name_or_path: embedded", "")
    recipe.write_text(f"model_name_or_path: {model_dir}\n{text}")
    seen = []
    sample_credit = MRTPOTrainer.sample_credit

    def recording(trainer, rows, num_generations):
        seen.append((trainer.environment_factories, list(trainer.tools or []), trainer.processing_class.chat_template))
        return sample_credit(trainer, rows, num_generations)

    monkeypatch.setattr(MRTPOTrainer, "sample_credit", recording)
    main(["inspect", "--config", str(recipe), "--num-prompts", "1", "--num-generations", "2", "--max-new-tokens", "8",
          "--output", str(tmp_path / "credit.html"), "--threads", "1"])  # fmt: skip
    (environments, tools, template) = seen[0]
    assert environments and tools, (environments, tools)
    assert template == open(f"{trl.__path__[0]}/chat_templates/qwen3.jinja").read()
    assert (tmp_path / "credit.html").is_file()
