"""The research room: its options reach only ResearchTrainer (MRTPOTrainer refuses them rather than ignore them), the
CLI routes them there with `trainer: research`, and with every option at its default it trains exactly as
MRTPOTrainer."""

import pytest
import torch

from tests.helpers import make_args, recording_trainer
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.research import ResearchConfig, ResearchTrainer
from trl_mrtpo.scripts.train import build_trainer, make_parser


def build(trainer_class, tiny_model, tiny_tokenizer, args):
    return trainer_class(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=args,
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )


@pytest.mark.parametrize(
    "settings, named",
    [
        (dict(credit_assignment="joint"), "credit_assignment='joint'"),
        (dict(taco_strength=0.5), "taco_strength=0.5"),
        (dict(reward_weighting="saw"), "reward_weighting='saw'"),
    ],
)
def test_mrtpo_trainer_refuses_research_options(tiny_model, tiny_tokenizer, tmp_path, settings, named):
    args = make_args(tmp_path, **settings)
    assert isinstance(args, ResearchConfig)
    with pytest.raises(ValueError, match=f"{named} belong to the research room: train with .*ResearchTrainer"):
        build(MRTPOTrainer, tiny_model, tiny_tokenizer, args)
    assert build(ResearchTrainer, tiny_model, tiny_tokenizer, args).args.credit_assignment == args.credit_assignment


def test_the_core_configuration_names_the_research_room_for_its_modes(tmp_path):
    from trl_mrtpo.rules import resolve_credit_rule

    with pytest.raises(ValueError, match="credit_assignment='cort' is unknown; .*trl_mrtpo.research.ResearchConfig"):
        resolve_credit_rule(MRTPOConfig(str(tmp_path), credit_assignment="cort", use_cpu=True, bf16=False))
    with pytest.raises(TypeError, match="__init__\\(\\) got an unexpected keyword argument 'taco_strength'"):
        MRTPOConfig(str(tmp_path), taco_strength=0.5, use_cpu=True, bf16=False)


def test_research_trainer_with_default_options_trains_as_mrtpo_trainer(tiny_tokenizer, tmp_path):
    """Same seed, same model, same data: the token advantages of every step are identical."""
    from tests.conftest import build_tiny_model

    runs = []
    for research in (False, True):
        trainer = recording_trainer(
            model=build_tiny_model(tiny_tokenizer),
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path / str(research), research=research),
            train_dataset=make_basic_dataset(8),
            processing_class=tiny_tokenizer,
        )
        assert isinstance(trainer, ResearchTrainer) == research
        trainer.train()
        runs.append(trainer.batches)
    assert len(runs[0]) == len(runs[1]) == 2
    for core, research in zip(*runs):
        torch.testing.assert_close(core["advantages"], research["advantages"], rtol=0, atol=0)
        assert core["advantages"].abs().sum() > 0


def test_the_cli_routes_research_options_to_the_research_trainer(monkeypatch, tmp_path):
    import trl_mrtpo.research

    class Recorded:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    monkeypatch.setattr(trl_mrtpo.research, "ResearchTrainer", Recorded)
    argv = ["--config", "recipes/cpu/basic-smollm2.yaml", "--model_name_or_path", "some/model", "--output_dir",
            str(tmp_path), "--credit_assignment", "shuffled"]  # fmt: skip
    with pytest.raises(ValueError, match="credit_assignment='shuffled' belong to the research room: add `trainer"):
        build_trainer(*make_parser().parse_args_and_config(argv))
    built = build_trainer(*make_parser().parse_args_and_config([*argv, "--trainer", "research"]))
    assert isinstance(built, Recorded) and built.kwargs["args"].credit_assignment == "shuffled"
