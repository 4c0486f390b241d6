"""Every TRL loss and importance-sampling option either lets MRTPO's per-token credit move the gradient or is refused
at start-up: a gradient check on one batch, token advantages against the same advantages averaged over each row."""

import pytest
import torch

from tests.helpers import make_args
from trl_mrtpo import MRTPOTrainer
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset

# TRL 1.16's loss types (GRPOConfig.loss_type's help lists the same eight).
LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LEVELS = ["token", "sequence"]


def test_the_loss_list_is_trls():
    from trl import GRPOConfig

    help_text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    listed = help_text.split("Supported values are ")[1].split(".")[0]
    assert sorted(name.strip(" '") for name in listed.replace(" and ", ",").split(",") if name.strip()) == sorted(
        LOSS_TYPES
    )


def build(tiny_model, tiny_tokenizer, tmp_path, **overrides):
    return MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, credit_assignment="mrtpo", **overrides),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )


def loss_gradient(trainer, inputs) -> torch.Tensor:
    trainer.model.zero_grad()
    trainer._compute_loss(trainer.model, inputs).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def batch_inputs(tokenizer, generator) -> dict:
    """Four completions of different lengths, token advantages that change sign along each row, and old log-probs
    a little off the policy's (the ratio is not 1, so clipping can bind)."""
    batch, prompt_len, length = 4, 6, 8
    prompt_ids = torch.randint(5, len(tokenizer), (batch, prompt_len), generator=generator)
    completion_ids = torch.randint(5, len(tokenizer), (batch, length), generator=generator)
    completion_mask = torch.ones(batch, length, dtype=torch.long)
    for row, cut in enumerate((8, 6, 5, 3)):
        completion_mask[row, cut:] = 0
    advantages = torch.randn(batch, length, generator=generator) * completion_mask
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": advantages,
        "num_items_in_batch": completion_mask.sum(),
    }


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_token_credit_reaches_the_gradient_or_is_refused(tiny_model, tiny_tokenizer, tmp_path, loss_type, level):
    try:
        trainer = build(tiny_model, tiny_tokenizer, tmp_path, loss_type=loss_type, importance_sampling_level=level)
    except ValueError as error:
        # refused: only where the sequence-level ratio would drop the credit, and the message says what to use
        assert level == "sequence", error
        assert "importance_sampling_level" in str(error) and "'token'" in str(error) and loss_type in str(error)
        return
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # what a training step sets before the loss
    inputs = batch_inputs(tiny_tokenizer, torch.Generator().manual_seed(0))
    with torch.no_grad():  # old log-probs off the policy's, so the ratio is not 1
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].shape[1],
        )
    inputs["old_per_token_logps"] = logps + 0.05 * torch.randn(logps.shape, generator=torch.Generator().manual_seed(1))
    token = loss_gradient(trainer, inputs)
    mask = inputs["completion_mask"]
    row_mean = (inputs["advantages"] * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
    uniform = loss_gradient(trainer, {**inputs, "advantages": row_mean * mask})
    relative = (token - uniform).norm() / uniform.norm()
    assert relative > 0.05, f"{loss_type}/{level}: token credit moved the gradient by only {relative:.2e}"


@pytest.mark.parametrize("loss_type", ["grpo", "luspo"])
def test_sequence_level_is_accepted_where_credit_is_uniform(tiny_model, tiny_tokenizer, tmp_path, loss_type):
    """GSPO with uniform credit (gdpo, or no info blocks) loses nothing: it is not refused."""
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, credit_assignment="gdpo", loss_type=loss_type, importance_sampling_level="sequence"),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    assert trainer.importance_sampling_level == "sequence"
