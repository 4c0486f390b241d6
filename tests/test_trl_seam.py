"""The one seam to TRL: every private name the package relies on exists in the installed TRL, and no other module
reaches TRL's private helpers directly."""

import inspect
import re
from pathlib import Path

import torch

from trl_mrtpo import _trl

PACKAGE = Path(_trl.__file__).parent


def test_installed_trl_has_every_name_we_use():
    missing = _trl.missing_names()
    assert not missing, f"the installed TRL lacks {missing}: update trl_mrtpo/_trl.py for this TRL version"


def missing_transformers_names(model) -> list[str]:
    """What the installed transformers lacks of ``_trl.TRANSFORMERS_NAMES``, the model's names read on ``model`` (a
    plain causal LM)."""
    import transformers
    from transformers import cache_utils

    present = {
        "PretrainedConfig._attn_implementation": hasattr(model.config, "_attn_implementation"),
        "FalconConfig.alibi": hasattr(transformers.FalconConfig(), "alibi"),
        "MptConfig.attn_config.alibi": hasattr(transformers.MptConfig().attn_config, "alibi"),
        "xLSTMConfig.output_logit_soft_cap": hasattr(transformers.xLSTMConfig(), "output_logit_soft_cap"),
        "PreTrainedModel._tp_size": hasattr(model, "_tp_size"),
        "PretrainedConfig._is_quantized": "_is_quantized" in inspect.getsource(transformers.configuration_utils),
    }
    present.update(
        {name: hasattr(cache_utils, name.split(".")[1]) for name in _trl.TRANSFORMERS_NAMES if "cache_utils" in name}
    )
    return [name for name in _trl.TRANSFORMERS_NAMES if not present[name]]


def test_installed_transformers_has_every_name_we_read(tiny_model, monkeypatch):
    missing = missing_transformers_names(tiny_model)
    assert not missing, f"the installed transformers lacks {missing}: update trl_mrtpo/_trl.py and its readers"
    # planted: a release that drops a cache class or renames the attention field is named
    from transformers import cache_utils

    monkeypatch.delattr(cache_utils, "LinearAttentionCacheLayerMixin")
    owner = next(c for c in type(tiny_model.config).__mro__ if "_attn_implementation" in vars(c))
    monkeypatch.delattr(owner, "_attn_implementation")
    assert missing_transformers_names(tiny_model) == [
        "PretrainedConfig._attn_implementation",
        "cache_utils.LinearAttentionCacheLayerMixin",
    ]


def test_every_hook_is_called_and_every_attribute_is_set_by_trl(tiny_model, tiny_tokenizer, tmp_path):
    """By behaviour, not by reading TRL's source: two steps with a checkpoint, then a resume; every GRPOTrainer
    method MRTPO overrides or calls is reached, and every attribute it reads is set on the trainer. A TRL release
    that stops calling one (a renamed hook MRTPO's override would silently miss) fails here."""
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    called = set()

    def counting(name):
        method = getattr(MRTPOTrainer, name)

        def wrapper(self, *args, **kwargs):
            called.add(name)
            return method(self, *args, **kwargs)

        return wrapper

    Counting = type("Counting", (MRTPOTrainer,), {name: counting(name) for name in _trl.GRPO_TRAINER_NAMES})

    def trainer(max_steps):
        return Counting(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2, log_completions=True),
            train_dataset=make_basic_dataset(12),
            processing_class=tiny_tokenizer,
        )

    first = trainer(2)
    assert all(hasattr(first, name) for name in _trl.GRPO_TRAINER_ATTRIBUTES)
    first.train()
    trainer(3).train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    # only with tools (tests/test_inspection.py's recorded trajectories)
    expected = set(_trl.GRPO_TRAINER_NAMES) - {"_tool_call_loop"}
    assert called == expected, expected - called
    logged = first.state.log_history[0]
    assert "mrtpo/replay_share" in logged  # written through the seam's log_metric


def private_reaches(text: str) -> list[str]:
    """What a module's text reaches of TRL's private names: its private modules and helpers, and a private method
    of TRL's trainers (``GRPO_TRAINER_NAMES``, ``SDFT_TRAINER_NAMES``) called on anything but ``self`` or ``super()``
    (an override calling its own, as the trainer does)."""
    helpers = re.compile(
        r"from trl\.(kernels|trainer\.utils)|\._tokenize_prompts\(|ChunkedLogProbFunction\.apply"
        r"|\._metrics\[|\._logs\["
    )
    methods = "|".join(map(re.escape, [*_trl.GRPO_TRAINER_NAMES, *_trl.SDFT_TRAINER_NAMES]))
    calls = re.finditer(rf"(\w+(?:\([^()]*\))?)\.({methods})\(", text)
    own = [f"{m[1]}.{m[2]}(" for m in calls if m[1] != "self" and not m[1].startswith("super(")]
    return [m.group(0) for m in helpers.finditer(text)] + own


def test_only_the_seam_reaches_trl_private_helpers():
    """Outside the seam, nothing calls TRL's private helpers or a trainer's private method (inspect sampled credit
    through ``trainer._generate_and_score_completions`` before; it calls the trainer's public ``sample_credit``)."""
    offenders = {
        str(path.relative_to(PACKAGE)): reached
        for path in PACKAGE.rglob("*.py")
        if path.name != "_trl.py" and (reached := private_reaches(path.read_text()))
    }
    assert not offenders, offenders
    # planted: the calls this test exists to catch, and the overrides' own calls it lets through
    assert private_reaches("trainer._generate_and_score_completions(inputs)") == [
        "trainer._generate_and_score_completions("
    ]
    assert private_reaches("from trl.trainer.utils import pad") and private_reaches("x._calculate_rewards(a)")
    assert not private_reaches("super()._save_checkpoint(model, trial); self._save_rng_state(output_dir)")
    assert not private_reaches("super(replaying, self)._tool_call_loop(*args)")


def test_sampled_token_logprobs_match_log_softmax():
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 8, generator=gen), torch.randn(50, 8, generator=gen)
    ids = torch.randint(0, 50, (5,), generator=gen)
    got = _trl.sampled_token_logprobs(hidden, weight, None, ids, 0.7, 16)
    expected = torch.log_softmax((hidden.double() @ weight.double().T) / 0.7, -1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_core_imports_no_application():
    """Importing the trainer and its configuration loads nothing of ``trl_mrtpo.scripts`` (commands, the embedded
    demo model, evaluation) nor of the research room: the core stands alone."""
    import subprocess
    import sys

    code = (
        "import sys, trl_mrtpo\n"
        "from trl_mrtpo import MRTPOConfig, MRTPOTrainer\n"
        "from trl_mrtpo.kits import get_kit\n"
        "import trl_mrtpo.model_card, trl_mrtpo.baselines.opsd, trl_mrtpo.steps.step_labels\n"
        "rooms = ('trl_mrtpo.scripts', 'trl_mrtpo.research')\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(rooms))\n"
        "assert not loaded, loaded\n"
        "from trl_mrtpo.scripts.inspection import inspect_credit\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_top_level_is_the_trainers():
    """Four names at the top level, as TRL's trainers export theirs; everything else from its own module."""
    import pytest

    import trl_mrtpo

    assert sorted(n for n in trl_mrtpo.__all__ if n != "__version__") == [
        "InfoBlock",
        "InfoBlockError",
        "MRTPOConfig",
        "MRTPOTrainer",
    ]
    with pytest.raises(AttributeError):
        trl_mrtpo.MathShepherd  # noqa: B018  (trl_mrtpo.steps.step_labels.MathShepherd)


def test_sharding_refuses_only_what_it_cannot_run(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    """Under ZeRO-3 or FSDP every forward is a collective and ranks replay different amounts: refused at start-up,
    naming the engine and what runs the forwards, before the temperature probe that would crash on sharded weights."""
    import pytest

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.baselines.self_certainty import SelfCertaintyReward
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    def build(mode, rewards=BASIC.rewards, blocks=BASIC.info_blocks, **overrides):
        return MRTPOTrainer(
            model=tiny_model,
            reward_funcs=rewards,
            info_blocks=blocks,
            args=make_args(tmp_path, credit_assignment=mode, **overrides),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )

    for engine in ("DeepSpeed ZeRO-3", "FSDP2", "FSDP1"):
        monkeypatch.setattr("trl_mrtpo._trl.sharding_engine", lambda trainer, engine=engine: engine)
        with pytest.raises(ValueError, match=f"'self_certainty' run the policy .* {engine} does not support"):
            build("gdpo", [*BASIC.rewards, SelfCertaintyReward()], [*BASIC.info_blocks, None])
        if engine == "FSDP1":
            with pytest.raises(ValueError, match="credit_assignment='mrtpo' replay .* not supported under FSDP1"):
                build("mrtpo")
        else:  # the replay runs on the policy gathered whole
            assert build("mrtpo").args.credit_assignment == "mrtpo"
        if engine == "DeepSpeed ZeRO-3":  # ... which a user who turned TRL's gather off does not have
            with pytest.raises(ValueError, match="ds3_gather_for_generation=False the policy is never gathered"):
                build("mrtpo", ds3_gather_for_generation=False)
        assert build("gdpo").args.credit_assignment == "gdpo"  # no extra forward: uniform credit trains sharded


def test_the_sharding_engine_is_read_from_the_accelerator_state():
    from types import SimpleNamespace

    from trl_mrtpo._trl import sharding_engine

    def trainer(fsdp_version=None, stage=None):
        state = SimpleNamespace(
            deepspeed_plugin=SimpleNamespace(zero_stage=stage) if stage else None,
            fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version) if fsdp_version else None,
        )
        return SimpleNamespace(accelerator=SimpleNamespace(state=state))

    assert sharding_engine(trainer()) is None
    assert sharding_engine(trainer(fsdp_version=2)) == "FSDP2"
    assert sharding_engine(trainer(fsdp_version=1)) == "FSDP1"
    assert sharding_engine(trainer(stage=3)) == "DeepSpeed ZeRO-3"
    assert sharding_engine(trainer(stage=2)) is None


def test_an_lm_head_subclass_is_accepted_and_lora_on_it_named():
    """FSDP2 swaps the lm_head's class for an nn.Linear subclass: accepted; a PEFT layer on it is named as such."""
    import pytest
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.conftest import build_tiny_model, build_tiny_tokenizer
    from trl_mrtpo.replay import causal_lm_parts

    model = build_tiny_model(build_tiny_tokenizer())
    head = model.get_output_embeddings()
    head.__class__ = type("FSDPLinear", (torch.nn.Linear,), {})
    assert causal_lm_parts(model)[1] is head
    lora = get_peft_model(build_tiny_model(build_tiny_tokenizer()), LoraConfig(r=2, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="carries a PEFT adapter"):
        causal_lm_parts(lora)


def test_an_fsdp_config_on_a_cpu_machine_is_named(tmp_path, capsys):
    """accelerate's CPU backend ignores the FSDP plugin: the launch says so instead of pretending to shard."""
    import torch

    from trl_mrtpo.scripts.train import warn_fsdp_on_cpu

    if torch.cuda.is_available():
        return
    fsdp, ddp = tmp_path / "fsdp.yaml", tmp_path / "ddp.yaml"
    fsdp.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    ddp.write_text("distributed_type: MULTI_CPU\n")
    assert warn_fsdp_on_cpu(["--config_file", str(fsdp)])
    assert "ignores the FSDP plugin" in capsys.readouterr().err
    assert not warn_fsdp_on_cpu(["--config_file", str(ddp)])
