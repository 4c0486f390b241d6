"""The OPSD comparison arm: the info blocks as privileged context of TRL's SDFT trainer, with a live teacher."""

import math

import pytest
from datasets import Dataset

from tests.helpers import make_args
from trl_mrtpo import _trl
from trl_mrtpo.baselines.opsd import opsd_config, opsd_trainer_class, privileged_context, with_privileged_context
from trl_mrtpo.kits import get_kit
from trl_mrtpo.kits.basic import make_basic_dataset


def test_privileged_context_holds_the_blocks_that_need_no_response(tmp_path):
    tools = get_kit("tools")
    row = tools.dataset(0, 0, None)[0]
    context = privileged_context(row["prompt"], row, tools.info_blocks, ["format", "correct"], "\n\n")
    format_rule, reference = context.split("\n\n", 1)
    assert format_rule.startswith("Format:") and '"name"' in reference
    assert format_rule == tools.info_blocks[0](prompt=None, completion="", row=row, score=math.nan)
    assert reference == tools.info_blocks[1](prompt=None, completion="", row=row, score=math.nan)
    sql = get_kit("sql")
    row = sql.dataset(0, 0, str(tmp_path))[0]
    context = privileged_context(row["prompt"], row, sql.info_blocks, ["f", "e", "x"], "\n\n")
    assert "Your SQL failed" not in context  # the error block is about a response: never privileged
    assert context.endswith(f"```sql\n{row['query']}\n```")
    basic = get_kit("basic")  # in-prompt kit: the constraint sentences, restated
    row = make_basic_dataset(1)[0]
    context = privileged_context(row["prompt"], row, basic.info_blocks, ["a", "b", "c", "d"], " | ")
    assert context.count(" | ") == 2 and all(part in row["prompt"][-1]["content"] for part in context.split(" | "))


def test_no_privileged_information_is_refused():
    dataset = Dataset.from_list([{"prompt": "hi"}] * 2)
    with pytest.raises(ValueError, match="OPSD has no privileged information"):
        with_privileged_context(dataset, [None, lambda **_: None], ["a", "b"], "\n")


def test_opsd_trains_with_trls_sdft_and_logs_the_rewards(tiny_model, tiny_tokenizer, tmp_path):
    from trl.experimental.sdft import SDFTTrainer

    kit = get_kit("basic")
    args = opsd_config(make_args(tmp_path, max_steps=2, learning_rate=1e-4, temperature=0.9))
    assert args.teacher_model_kind == "live" and args.learning_rate == 1e-4 and args.temperature == 0.9
    batches = []

    class Recording(opsd_trainer_class()):
        def sample_rollouts(self, inputs):
            batch = super().sample_rollouts(inputs)
            batches.append(batch)
            return batch

    trainer = Recording(
        tiny_model, kit.rewards, kit.info_blocks, args, make_basic_dataset(8), processing_class=tiny_tokenizer
    )
    assert isinstance(trainer, SDFTTrainer)  # TRL's distillation, not ours
    trainer.train()
    # the seam to SDFT, by behaviour: TRL calls the hook the arm overrides, sets what it reads, returns what it reads
    assert batches and all(set(_trl.SDFT_BATCH_KEYS) <= set(batch) for batch in batches)
    assert all(hasattr(trainer, name) for name in _trl.SDFT_TRAINER_ATTRIBUTES)
    logged = trainer.state.log_history[0]
    names = [f.__name__ for f in kit.rewards]
    assert all(0.0 <= logged[f"rewards/{name}/mean"] <= 1.0 for name in names)
    assert logged["reward"] == pytest.approx(sum(logged[f"rewards/{name}/mean"] for name in names))
    assert math.isfinite(logged["self_distillation/distillation_loss"])


def test_a_failing_builder_is_named_with_its_row():
    from trl_mrtpo.info_blocks import InfoBlockError

    dataset = Dataset.from_list([{"prompt": "hi", "ok": True}, {"prompt": "there", "ok": False}])

    def picky(*, row, **_):
        if not row["ok"]:
            raise KeyError("missing")
        return "context"

    with pytest.raises(InfoBlockError, match="reward 'picky_reward' on sample 1"):
        with_privileged_context(dataset, [picky], ["picky_reward"], "\n")
