"""MRTPOTrainer end to end on a tiny random Llama built in the test (no hub)."""

import math
import warnings

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig

from tests.helpers import RecordingTrainer, graded_length, graded_length_too, make_args, recording_trainer, train
from trl_mrtpo import InfoBlock, InfoBlockError, MRTPOTrainer
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.scripts.inspection import sample_credit

LOSS_TYPES = ["dapo", "grpo", "dr_grpo", "bnpo", "cispo", "sapo"]
MODES = ["mrtpo", "gdpo", "grpo", "joint", "shuffled"]


def assert_token_advantages(trainer):
    assert trainer.batches
    for batch in trainer.batches:
        adv, mask = batch["advantages"], batch["completion_mask"]
        assert adv.shape == batch["completion_ids"].shape
        assert torch.isfinite(adv).all()
        assert (adv[mask == 0] == 0).all()


# Every mode at TRL's default loss, and every loss at mode mrtpo: the loss reads the same [B, C] advantages whatever
# mode wrote them, so the full product would repeat the same behaviour.
@pytest.mark.parametrize(
    "mode, loss_type", [(m, "dapo") for m in MODES] + [("mrtpo", loss) for loss in LOSS_TYPES if loss != "dapo"]
)
def test_two_steps_each_mode_and_loss_with_lora(tiny_model, tiny_tokenizer, tmp_path, mode, loss_type):
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, credit_assignment=mode, loss_type=loss_type, num_iterations=2),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )
    trainer.train()
    assert trainer.state.global_step == 2
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert len(history) == 2 and all(math.isfinite(h["loss"]) for h in history)
    if mode == "grpo":  # plain GRPOTrainer behaviour: one advantage per sequence
        assert all(b["advantages"].dim() == 1 for b in trainer.batches)
        assert not trainer.replays
        return
    assert_token_advantages(trainer)
    logged = trainer.state.log_history[0]
    assert logged["mrtpo/beta"] == (0.0 if mode == "gdpo" else 0.5)
    if mode == "gdpo":
        assert not trainer.replays
        for batch in trainer.batches:  # uniform within each response
            adv, mask = batch["advantages"], batch["completion_mask"].bool()
            for row, m in zip(adv, mask):
                assert torch.allclose(row[m], row[m][0].expand(int(m.sum())))
    else:
        assert trainer.replays and logged["mrtpo/replayed_fraction"] > 0


def test_replayed_q_matches_two_plain_forwards_under_lora(tiny_model, tiny_tokenizer, tmp_path):
    """q for one replayed pair, recomputed by hand from two full-logits forwards in float64."""

    class CheckingTrainer(RecordingTrainer):
        def _replay(self, batch):
            relevance, replayed = super()._replay(batch)
            inputs, prompts, output = batch.inputs, batch.prompts, batch.output
            # Right here the policy holds the sampling-time weights. Sample 0, each constraint reward in turn (all
            # in-prompt blocks): q must sit on the reward whose span was removed.
            i = 0
            length = int(output["completion_mask"][i].sum())
            completion = output["completion_ids"][i, :length].tolist()
            user = prompts[i][-1]["content"]
            self.hand_q, self.hand_q_at_one, self.trainer_q = [], [], []
            model = self.model
            model.eval()
            for k, name in enumerate(("end_phrase", "keyword", "lowercase")):
                span = inputs[i]["constraints"][name]
                p_all = [{"role": "user", "content": user}]
                p_not = [{"role": "user", "content": user.replace(" " + span, "", 1).replace(span, "", 1)}]
                for temperature, profiles in ((self.temperature, self.hand_q), (1.0, self.hand_q_at_one)):
                    with torch.no_grad():
                        logprobs = []
                        for context in (p_all, p_not):
                            text = tiny_tokenizer.apply_chat_template(
                                context, add_generation_prompt=True, tokenize=False
                            )
                            ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
                            logits = model(input_ids=torch.tensor([ids + completion])).logits[0].double()
                            logits = logits[len(ids) - 1 : len(ids) - 1 + length] / temperature
                            logprobs.append(logits.log_softmax(-1))
                    p, q = logprobs[0].exp(), logprobs[1].exp()
                    m = 0.5 * (p + q)
                    js = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
                    profiles.append(js / math.log(2))
                self.trainer_q.append(relevance[i, k, :length])
            model.train()
            return relevance, replayed

    trainer = CheckingTrainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=1, temperature=0.5),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    trainer.train()
    for hand, at_one, placed in zip(trainer.hand_q, trainer.hand_q_at_one, trainer.trainer_q):
        assert hand.max() > 1e-5  # the removed span matters to this model
        torch.testing.assert_close(placed.double(), hand, atol=2e-6, rtol=1e-4)
        # replayed at the sampling temperature (0.5), not at 1: far closer to the first than to the second
        assert (placed.double() - hand).norm() < 0.1 * (at_one - hand).norm()
    # the three profiles differ, so q placed on the wrong reward would not pass
    assert all(not torch.allclose(a, b, atol=1e-6) for a, b in zip(trainer.hand_q, trainer.hand_q[1:]))


def test_appended_blocks_with_plain_prompts(tiny_model, tiny_tokenizer, tmp_path):
    dataset = Dataset.from_list([{"prompt": f"Question {i}: name a colour.", "answer": "blue"} for i in range(4)])

    def has_answer(completions, answer, **_):
        return [float(a in c) for c, a in zip(completions, answer)]

    def short(completions, **_):
        return [float(len(c) < 20) for c in completions]

    seen = []

    def reference_block(*, prompt, completion, row, score):
        seen.append((prompt, row["answer"], score))
        return f"Reference answer: {row['answer']}"

    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=[has_answer, short],
        info_blocks=[reference_block, lambda **_: "Rule: fewer than 20 characters."],
        args=make_args(tmp_path),
        train_dataset=dataset,
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert_token_advantages(trainer)
    assert seen and all(isinstance(p, str) and a == "blue" for p, a, _ in seen)
    replay = trainer.replays[0]
    assert replay["replayed"].all()  # replay_only_varying=False: every pair with a block
    # appended blocks change the context, so each replayed profile carries mass, and nothing sits on padding
    mask = replay["output"]["completion_mask"].bool()[:, None].expand_as(replay["relevance"])
    assert (replay["relevance"] * mask).sum(-1).gt(0).all()
    assert (replay["relevance"][~mask] == 0).all()


def test_replay_only_varying_skips_constant_rewards(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    import trl_mrtpo.relevance

    forwards = []
    monkeypatch.setattr(trl_mrtpo.relevance, "replay_relevance", lambda *a, **k: forwards.append(a))

    def constant(completions, **_):
        return [1.0] * len(completions)

    trainer = train(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[constant, BASIC.rewards[3]],
        blocks=[lambda **_: "Constant rule.", None],
        replay_only_varying=True,
    )
    assert not forwards  # nothing varies with a block: no replay forward at all
    assert all(h.get("mrtpo/replayed_fraction", 0.0) == 0.0 for h in trainer.state.log_history)


def test_reward_none_for_whole_group_is_ignored(tiny_model, tiny_tokenizer, tmp_path):
    def not_applicable(completions, **_):
        return [None] * len(completions)

    trainer = train(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[not_applicable, *BASIC.rewards],
        blocks=[lambda **_: "Never used.", *BASIC.info_blocks],
        replay_only_varying=True,
    )
    assert_token_advantages(trainer)
    assert trainer.replays  # the other rewards were replayed: the loop below checks something
    for replay in trainer.replays:
        assert not replay["replayed"][:, 0].any()


def test_gradient_accumulation_steps_per_generation_and_eval(tiny_model, tiny_tokenizer, tmp_path):
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(
            tmp_path,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            eval_strategy="steps",
            eval_steps=2,
            per_device_eval_batch_size=4,
        ),
        train_dataset=make_basic_dataset(8),
        eval_dataset=make_basic_dataset(4, seed=1),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert_token_advantages(trainer)
    assert any("eval_loss" in h for h in trainer.state.log_history)
    assert any("eval_mrtpo/beta" in h for h in trainer.state.log_history)


def test_logged_advantages_are_the_token_advantages(tiny_model, tiny_tokenizer, tmp_path):
    trainer = train(tiny_model, tiny_tokenizer, tmp_path, max_steps=1)
    batch = trainer.batches[-1]
    mask = batch["completion_mask"]
    expected = ((batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)).tolist()
    assert list(trainer._logs["advantages"])[-len(expected) :] == pytest.approx(expected)


def test_model_card_names_mrtpo(tiny_model, tiny_tokenizer, tmp_path):
    trainer = train(tiny_model, tiny_tokenizer, tmp_path, max_steps=1)
    trainer.create_model_card(model_name="tiny-mrtpo")
    card = (tmp_path / "README.md").read_text()
    assert "mrtpo" in card and "Each Reward to Its Relevant Tokens" in card
    assert "credit assignment: `mrtpo`" in card and "- credit_beta: 0.5" in card
    # every value is filled in: the one None is the tiny runs' published rule, named against the default
    assert card.count("None") == card.count("reward_strength_floor: None (default 0.25)") == 1
    assert "| `end_phrase_reward` | 1 | `end_phrase_block` |" in card
    assert "| `length_reward` | 1 | none (uniform credit) |" in card
    assert "credit_warmup_steps: 0" in card and "replay_only_varying: False (default True)" in card
    assert "a local model" in card  # the tiny model is a local folder nobody else could load: no base_model link
    assert "## Training procedure\n\nThis model was trained with" in card  # no blank lines where badges are absent


# ---------------------------------------------------------------- bad input
def test_reward_returning_wrong_length_names_the_reward(tiny_model, tiny_tokenizer, tmp_path):
    def broken(completions, **_):
        return [1.0]

    with pytest.raises(ValueError, match="'broken' returned 1 rewards"):
        train(tiny_model, tiny_tokenizer, tmp_path, rewards=[broken, *BASIC.rewards[1:]])


def test_builder_raising_names_reward_and_sample(tiny_model, tiny_tokenizer, tmp_path):
    def fragile(*, prompt, completion, row, score):
        raise KeyError("reference_query")

    with pytest.raises(InfoBlockError, match=r"reward 'end_phrase_reward' on sample 0 .*KeyError"):
        train(tiny_model, tiny_tokenizer, tmp_path, blocks=[fragile, *BASIC.info_blocks[1:]])


def test_builder_returning_non_string_names_reward_and_sample(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(InfoBlockError, match=r"reward 'keyword_reward' on sample 0 .*returned list"):
        train(tiny_model, tiny_tokenizer, tmp_path, blocks=[None, lambda **_: ["x"], None, None])


def test_in_prompt_block_that_is_not_a_span(tiny_model, tiny_tokenizer, tmp_path):
    def wrong_span(**_):
        return InfoBlock("This sentence is not in the prompt.", placement="in_prompt")

    with pytest.raises(InfoBlockError, match="reward 'end_phrase_reward' on sample 0 .*not a span"):
        train(tiny_model, tiny_tokenizer, tmp_path, blocks=[wrong_span, None, None, None])


def test_info_blocks_of_wrong_length(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="info_blocks has 2 entries but there are 4 reward functions"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks[:2],
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(8),
            processing_class=tiny_tokenizer,
        )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("credit_beta", 1.5, "credit_beta must be in"),
        ("credit_warmup_steps", -1, "credit_warmup_steps"),
        ("max_second_moment_ratio", 0.5, "max_second_moment_ratio"),
        ("replay_batch_size", 0, "replay_batch_size"),
        ("replay_chunk_size", 0, "replay_chunk_size"),
        ("replay_min_shared_prefix", 0, "replay_min_shared_prefix"),
        ("divergence_backend", "cuda", "divergence_backend"),
        ("cort_eta", 2.0, "cort_eta"),
        ("reward_weighting", "dynamic", "reward_weighting"),
        ("concur_ceiling_mode", "always", "concur_ceiling_mode"),
        ("concur_min_readings", 1, "concur_min_readings"),
        ("taco_strength", 1.5, "taco_strength"),
    ],
)
def test_config_rejects_bad_values(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        make_args(tmp_path, **{field: value})


def test_grpo_mode_refuses_weighting_and_taco(tmp_path):
    with pytest.raises(ValueError, match="gdpo"):
        make_args(tmp_path, credit_assignment="grpo", reward_weighting="saw")
    with pytest.raises(ValueError, match="gdpo"):
        make_args(tmp_path, credit_assignment="grpo", taco_strength=0.5)


def test_trainer_requires_mrtpo_config(tiny_model, tiny_tokenizer, tmp_path):
    from trl import GRPOConfig

    with pytest.raises(TypeError, match="MRTPOConfig"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            args=GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False),
        )


def test_lora_on_lm_head_is_refused_at_init(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="target_modules"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path),
            train_dataset=make_basic_dataset(8),
            processing_class=tiny_tokenizer,
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "lm_head"]),
        )


def test_collapse_warning_and_credit_plot(tiny_model, tiny_tokenizer, tmp_path, monkeypatch):
    import trl_mrtpo.trainer
    from trl_mrtpo.observability.callbacks import CreditPlotCallback, logged_reward_names

    warnings = []
    monkeypatch.setattr(trl_mrtpo.diagnostics.logger, "warning", lambda message: warnings.append(message))
    trainer = recording_trainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, collapse_warning_steps=2),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
        callbacks=[CreditPlotCallback()],
    )
    trainer._collapse_monitor.threshold = 1.0  # every q of the random model counts as collapsed
    trainer.train()
    assert any("end_phrase_reward" in w and "plain GDPO" in w for w in warnings)
    assert (tmp_path / "mrtpo_curves.png").stat().st_size > 1000
    assert logged_reward_names(trainer.state.log_history) == trainer.reward_func_names  # the curves' rewards


def test_completions_table_gets_a_credit_column(tiny_model, tiny_tokenizer, tmp_path):
    trainer = train(tiny_model, tiny_tokenizer, tmp_path, max_steps=1, log_completions=True)
    column = list(trainer._logs["extra"]["mrtpo_credit"])
    assert len(column) == len(trainer._logs["prompt"]) == 4
    assert all(line.startswith("top |A_t|: ") for line in column)
    assert any("end_phrase_reward q peaks at" in line for line in column)


# ---------------------------------------------------------------- exactness and refused options
@pytest.mark.parametrize("bad", [float("inf"), float("-inf")])
def test_non_finite_reward_names_the_reward_and_sample(tiny_model, tiny_tokenizer, tmp_path, bad):
    def exploding(completions, **_):
        return [1.0] * 2 + [bad] + [0.0] * (len(completions) - 3)

    message = r"reward function 'exploding' returned -?inf for sample 2; rewards must be finite .*\(return None where"
    with pytest.raises(ValueError, match=message):
        train(tiny_model, tiny_tokenizer, tmp_path, rewards=[exploding, *BASIC.rewards[1:]])


def test_no_replay_for_a_response_whose_reward_is_none(tiny_model, tiny_tokenizer, tmp_path):
    def partly(completions, **_):  # varies in every group, but does not apply to odd samples
        return [None if i % 2 else float(i % 4 == 0) for i in range(len(completions))]

    trainer = train(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[partly, BASIC.rewards[3]],
        blocks=[lambda **_: "A rule.", None],
        replay_only_varying=True,
    )
    assert trainer.replays
    for replay in trainer.replays:
        replayed = replay["replayed"][:, 0].tolist()
        assert replayed[0::2] == [True] * len(replayed[0::2]) and not any(replayed[1::2])


@pytest.mark.parametrize(
    "field, value",
    [("scale_rewards", "batch"), ("scale_rewards", "none"), ("multi_objective_aggregation", "normalize_then_sum")],
)
@pytest.mark.parametrize("mode", ["mrtpo", "gdpo", "cort"])
def test_grpo_only_options_are_refused_in_other_modes(tmp_path, field, value, mode):
    with pytest.raises(ValueError, match=rf"{field}.*credit_assignment='grpo'"):
        make_args(tmp_path, credit_assignment=mode, **{field: value})
    make_args(tmp_path, credit_assignment="grpo", **{field: value})  # plain GRPOTrainer honours them


def test_string_prompt_with_an_assistant_header_refuses_appended_blocks(tiny_model, tiny_tokenizer, tmp_path):
    # the tiny chat template ends a rendered prompt with "<|assistant|>": an appended block would land after it
    dataset = Dataset.from_list([{"prompt": "<|user|>Say hi.<|end|><|assistant|>"}] * 8)

    def one(completions, **_):
        return [float(i % 2) for i in range(len(completions))]

    with pytest.raises(InfoBlockError, match=r"reward 'one' on sample 0.*assistant header '<\|assistant\|>'"):
        train(tiny_model, tiny_tokenizer, tmp_path, rewards=[one], blocks=[lambda **_: "A rule."], dataset=dataset)
    # a plain string prompt (no template applied) takes appended blocks as before
    trainer = train(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[one],
        blocks=[lambda **_: "A rule."],
        dataset=Dataset.from_list([{"prompt": "Say hi."}] * 8),
        max_steps=1,
    )
    assert trainer.replays and trainer.replays[0]["replayed"].any()


@pytest.mark.parametrize(
    "overrides",
    [
        {"credit_assignment": "mrtpo", "reward_strength_floor": 0.003},  # per-reward strength's specificity: state
        {"credit_assignment": "gdpo"},
        {"credit_assignment": "grpo"},
        {"credit_assignment": "joint"},
        {"credit_assignment": "shuffled"},
        {"credit_assignment": "cort"},
        {"credit_assignment": "mrtpo", "reward_weighting": "saw"},
        {
            "credit_assignment": "mrtpo",
            "reward_weighting": "concur",
            "concur_min_readings": 2,
            "concur_pass_threshold": 0.3,
            "concur_ceiling": 0.5,
        },
        {"credit_assignment": "mrtpo", "taco_strength": 0.5},
        {"credit_assignment": "mrtpo", "relevance_null_correction": True},
        {"credit_assignment": "joint", "preserve_reward_totals": True},
    ],
    ids=["mrtpo", "gdpo", "grpo", "joint", "shuffled", "cort", "saw", "concur-adaptive", "taco", "null", "preserve"],
)
def test_resumed_run_continues_exactly(tiny_tokenizer, tmp_path, overrides):
    """Every credit rule and term, resumed from its own run's checkpoint in the middle of training, continues bit for
    bit as the uninterrupted run: the same completions and the same advantages after the checkpoint."""
    from tests.conftest import build_tiny_model

    def run(output_dir, resume=None):
        trainer = recording_trainer(
            model=build_tiny_model(tiny_tokenizer),
            reward_funcs=[graded_length, graded_length_too, *BASIC.rewards[:3]],
            info_blocks=[None, lambda **_: "Be long.", *BASIC.info_blocks[:3]],
            args=make_args(output_dir, max_steps=4, save_strategy="steps", save_steps=2, **overrides),
            train_dataset=make_basic_dataset(16),
            processing_class=tiny_tokenizer,
        )
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    assert len(full.batches) == 4 and len(resumed.batches) == 2
    if overrides.get("reward_weighting") == "concur":  # the state that must survive the checkpoint is not empty
        assert not full.credit_terms["reward_weighting"].trust[1].tie_ceiling()  # trusted: the tie is released
        # the cumulative readings continue from the checkpoint's, not from zero
        assert resumed.credit_terms["reward_weighting"].trust[1] == full.credit_terms["reward_weighting"].trust[1]
    for after, before in zip(resumed.batches, full.batches[2:]):
        torch.testing.assert_close(after["completion_ids"], before["completion_ids"], rtol=0, atol=0)
        torch.testing.assert_close(after["advantages"], before["advantages"], rtol=0, atol=0)
    # the state each run ends with is the same: what the checkpoint held was restored, not started afresh
    strength = full.reward_strength.specificity
    torch.testing.assert_close(resumed.reward_strength.specificity, strength, equal_nan=True, rtol=0, atol=0)
    assert "reward_strength_floor" not in overrides or not strength.isnan().all()  # read, so checkpointed
    assert resumed._collapse_monitor.streaks == full._collapse_monitor.streaks


def test_training_changes_every_parameter(tiny_model, tiny_tokenizer, tmp_path):
    """TRL's basic trainer test: after train(), every trainable parameter of the policy has moved."""
    from trl_mrtpo.utils import completion_text

    def distinct_characters(completions, **kwargs):  # varies within every group, so no advantage is all zero
        return [len(set(completion_text(c))) / 10 for c in completions]

    previous = {n: p.detach().clone() for n, p in tiny_model.named_parameters() if p.requires_grad}
    assert previous
    trainer = train(
        tiny_model,
        tiny_tokenizer,
        tmp_path,
        rewards=[*BASIC.rewards, distinct_characters],
        blocks=[*BASIC.info_blocks, None],
        learning_rate=1e-2,
    )
    assert trainer.state.log_history[-1]["train_loss"] is not None
    unchanged = [n for n, p in previous.items() if torch.equal(p, trainer.model.get_parameter(n))]
    assert not unchanged, unchanged


def test_the_first_generation_is_announced_once(tiny_model, tiny_tokenizer, tmp_path, capsys):
    trainer = train(tiny_model, tiny_tokenizer, tmp_path, disable_tqdm=False)
    out = capsys.readouterr().out
    assert out.count("Step 1: sampling 4 responses per process (4 per prompt), scoring 4 rewards, replaying") == 1
    assert trainer.state.global_step == 2
    train(tiny_model, tiny_tokenizer, tmp_path, disable_tqdm=True)  # progress bars off: silent
    assert "Step 1: sampling" not in capsys.readouterr().out
    # a generation outside training (what `inspect` runs) is not a training step: nothing to announce
    outside = recording_trainer(
        model=tiny_model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, disable_tqdm=False),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    record = sample_credit(outside, [make_basic_dataset(1)[0]], 4)
    assert record.completion_ids.shape[0] == 4 and outside.state.global_step == 0  # sampled, not trained
    assert "Step 1: sampling" not in capsys.readouterr().out


def test_a_warm_up_below_1_is_a_fraction_of_max_steps_and_a_short_run_is_warned(tiny_model, tiny_tokenizer, tmp_path):
    """transformers' convention for warm-up: 0.5 of 8 steps is 4, so beta is half way up its ramp at step 2 (it was
    read as 0.5 steps: full strength from step 1); and a run shorter than twice its warm-up says so, once."""
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    def trainer(**settings):
        return MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path, credit_beta=0.5, **settings),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )

    fraction = trainer(credit_warmup_steps=0.5, max_steps=8)
    fraction.state.max_steps, fraction.state.global_step = 8, 2
    assert fraction._beta() == pytest.approx(0.25)  # u = 2 / 4: 3u^2 - 2u^3 = 0.5
    short = trainer(credit_warmup_steps=10, max_steps=8)
    short.state.max_steps = 8
    with pytest.warns(UserWarning, match=r"max_steps=8 is under twice credit_warmup_steps=10.*beta reaches 0.39"):
        short._beta()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        short._beta()  # once


def test_the_card_compiles_for_any_output_dir_and_escapes_reward_names(tiny_model, tiny_tokenizer, tmp_path):
    """An output_dir holding a quote and a backslash still gives a quick start that compiles and names it; a reward
    whose name holds a `|` keeps the rewards table's columns."""
    import ast
    import re

    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer

    def piped(completions, **_):
        return [1.0] * len(completions)

    piped.__name__ = "format|strict"
    output_dir = tmp_path / 'run "a"\\b'
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=[piped, *BASIC.rewards[1:]],
        info_blocks=[None, *BASIC.info_blocks[1:]],
        args=make_args(output_dir),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.create_model_card()
    card = (output_dir / "README.md").read_text()
    (quick_start,) = re.findall(r"```python\n(.*?)```", card, re.DOTALL)
    ast.parse(quick_start)
    assert str(output_dir) in [
        node.value for node in ast.walk(ast.parse(quick_start)) if isinstance(node, ast.Constant)
    ]
    assert "| `format\\|strict` | 1 | none (uniform credit) |" in card


def test_the_model_card_breaks_on_names_links_untrusted_data_and_omits_process_rewards(
    tiny_model, tiny_tokenizer, tmp_path
):
    """A reward name holding a newline or a backtick keeps the rewards table's rows and columns; a dataset_name that
    is not a Hub id is plain text, never a link; a recipe path with a space is quoted in the train command; the
    process rewards and failure boundaries the run used are listed (each broke or was missing)."""
    import shlex

    from tests.helpers import make_args, word_steps
    from trl_mrtpo import MRTPOTrainer

    def odd(completions, **_):
        return [1.0] * len(completions)

    def boundary(*, completion, **_):
        return None

    odd.__name__ = "fmt\nline `x`"
    trainer = MRTPOTrainer(
        model=tiny_model,
        reward_funcs=[odd, *BASIC.rewards[1:]],
        info_blocks=[None, *BASIC.info_blocks[1:]],
        process_rewards=[word_steps],
        failure_boundaries=[None, boundary, None, None],
        args=make_args(tmp_path),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
        recipe="my recipes/sql run.yaml",
    )
    trainer.create_model_card(dataset_name="x) [click](javascript:alert(1)) (")
    card = (tmp_path / "README.md").read_text()
    table = [line for line in card.splitlines() if line.startswith("| ")]
    assert len(table) == 5 and all(line.count(" | ") == 2 for line in table), table  # header + 4 rewards
    assert "| `` fmt\\nline `x` `` | 1 | none (uniform credit) |" in card
    assert "](javascript" not in card and "https://huggingface.co/datasets/x)" not in card
    assert "x\\) \\[click\\]\\(javascript:alert\\(1\\)\\) \\(" in card
    assert f"trl-mrtpo train --config {shlex.quote('my recipes/sql run.yaml')}" in card
    assert "`word_steps`" in card and "`keyword_reward`: `boundary`" in card
    trainer.create_model_card(dataset_name="org/data-set_1.0")
    assert (
        "[org/data-set_1.0](https://huggingface.co/datasets/org/data-set_1.0)" in (tmp_path / "README.md").read_text()
    )


def test_a_model_trained_once_in_bf16_is_accepted_by_a_second_trainer(tiny_model, tiny_tokenizer, tmp_path):
    """accelerate leaves a bf16 run's autocast wrapper on the model's forward; a second trainer given the same model
    object (an fp32 run) takes it off before TRL patches the forward with its fused head, so its logit probe calls
    the model's own forward and it trains (it failed at its first step with 'CausalLMOutputWithPast' object has no
    attribute 'log_probs': the wrapper was stripped after TRL's patch, taking the patch with it)."""
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer

    def trainer(folder, **overrides):
        return MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path / folder, max_steps=1, **overrides),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )

    trainer("bf16", bf16=True).train()
    assert "_original_forward" in tiny_model.__dict__  # the first run's autocast, left behind
    second = trainer("fp32")
    assert "_original_forward" not in tiny_model.__dict__
    second.train()
    assert second.state.global_step == 1 and second.last_credit is not None
