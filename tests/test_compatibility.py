"""docs/compatibility.md against the code: every GRPOTrainer option it lists works, changes the credit as it says,
or is refused; the loss rows agree with the start-up check and every test it names exists."""

import ast
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import graded_length, make_args, recording_trainer
from tests.test_loss_options import LOSS_TYPES
from trl_mrtpo.checks.inputs import check_loss_keeps_token_credit
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "docs" / "compatibility.md"


def table_rows() -> list[tuple[str, str, str, str]]:
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0] not in ("option", "---") and not cells[0].startswith("-"):
            rows.append(tuple(cells))
    return rows


def test_every_named_test_exists():
    rows = table_rows()
    assert len(rows) >= 20
    for option, status, _, checked_by in rows:
        assert status in ("works", "changes credit", "not run here") or status.startswith("refused"), option
        if checked_by == "—":
            assert status == "not run here", option
            continue
        file, name = checked_by.strip("`").split("::")
        tree = ast.parse((ROOT / "tests" / file).read_text())
        assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, checked_by


def test_the_loss_rows_agree_with_the_start_up_check():
    rows = table_rows()
    token_rows = {re.search(r'loss_type="(\w+)"', o).group(1) for o, s, _, _ in rows if "token level" in o}
    assert token_rows == set(LOSS_TYPES) and all(s == "works" for o, s, _, _ in rows if "token level" in o)
    sequence = {o: s for o, s, _, _ in rows if o.startswith('`importance_sampling_level="sequence"`')}
    listed = {status: set(re.findall(r"`(\w+)`", option)) & set(LOSS_TYPES) for option, status in sequence.items()}
    refused = {loss for loss in LOSS_TYPES if _refused_at_sequence_level(loss)}
    assert listed == {"refused with token credit": refused, "works": set(LOSS_TYPES) - refused}


def _refused_at_sequence_level(loss: str) -> bool:
    try:
        check_loss_keeps_token_credit(loss, "sequence", ["credit_assignment='mrtpo'"])
    except ValueError:
        return True
    return False


@pytest.mark.parametrize(
    "option",
    [
        {"beta": 0.04},
        {"top_entropy_quantile": 0.5},
        {"off_policy_mask_threshold": 0.5, "num_iterations": 2},
        {"mask_truncated_completions": True},
    ],
    ids=lambda option: next(iter(option)),
)
def test_trl_option_keeps_token_credit(tiny_model, tiny_tokenizer, tmp_path, option):
    tiny_model.save_pretrained(tmp_path / "policy")  # by path, as a user passes it: TRL loads the reference from it
    trainer = recording_trainer(
        model=str(tmp_path / "policy"),
        reward_funcs=[graded_length, *BASIC.rewards[1:]],  # a fractional reward: it varies in every group
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, credit_assignment="mrtpo", max_steps=1, max_completion_length=16, **option),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    (batch,) = trainer.batches
    advantages, mask = batch["advantages"], batch["completion_mask"]
    assert advantages.shape == mask.shape and torch.isfinite(advantages).all()
    assert (advantages[mask == 0] == 0).all()  # masked (e.g. truncated) completions carry no credit
    assert trainer.state.log_history[-1]["train_loss"] == trainer.state.log_history[-1]["train_loss"]  # not NaN
    if option.get("mask_truncated_completions"):
        return
    spread = [row[m.bool()] for row, m in zip(advantages, mask) if m.sum() > 1]
    assert any(row.max() > row.min() for row in spread), "no response got token-level credit"


def test_a_reward_model_among_the_rewards(tiny_model, tiny_tokenizer, tmp_path):
    from transformers import LlamaForSequenceClassification

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    reward_model = LlamaForSequenceClassification(tiny_llama_config(tiny_tokenizer, num_labels=1))
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[*BASIC.rewards, reward_model],
        reward_processing_classes=[None] * len(BASIC.rewards) + [tiny_tokenizer],
        info_blocks=[*BASIC.info_blocks, None],
        args=make_args(tmp_path, credit_assignment="mrtpo", max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    model_rewards = trainer.last_credit.rewards[:, -1]
    assert torch.isfinite(model_rewards).all() and model_rewards.std() > 0  # scored, varied, normalised per group
    assert torch.isfinite(trainer.batches[0]["advantages"]).all()


@pytest.mark.parametrize("asked", [None, True, False])
def test_activation_checkpointing_reaches_the_transformers_installed(tmp_path, asked):
    """transformers renamed gradient_checkpointing to activation_checkpointing; the stack ``[vllm]`` resolves to an
    older transformers that reads only the old name. Either way the Trainer sees what the user asked (on by default,
    as in TRL), under the name it reads; on the older release the old name is not called deprecated."""
    import dataclasses
    import warnings

    from transformers import TrainingArguments

    from trl_mrtpo import MRTPOConfig

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kwargs = {} if asked is None else {"activation_checkpointing": asked}
        config = MRTPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kwargs)
    renamed = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
    read = config.activation_checkpointing if renamed else config.gradient_checkpointing
    assert read is (True if asked is None else asked)
    assert not [w for w in caught if "gradient_checkpointing" in str(w.message)]
    if not renamed:  # the old name, as a user of that release writes it
        old_name = MRTPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, gradient_checkpointing=False)
        assert old_name.gradient_checkpointing is False
