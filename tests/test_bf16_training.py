"""The trainer on bf16 policies, as users train: tiny random models of the recipes' architectures (Llama, Qwen2, Qwen3:
configs built offline with the real ``tie_word_embeddings`` and a vocabulary larger than the tokenizer, as Qwen's
configs have), cast to bf16, ``bf16=True``, every replaying mode, LoRA and full fine-tuning.

Two separate bounds, written before the tests were first run:
(a) the advantages the loss receives equal the float64 reference computed from the trainer's own q (as in fp32);
(b) that q equals an fp32 replay of the same rounded weights within the noise floor of bf16 arithmetic measured in
    ``benchmarks/bf16_replay.md`` (up to 8.7 % of a reward's median q on SmolLM2): here the mean |q_bf16 - q_fp32| is
    at most :data:`BF16_NOISE_FLOOR` of the mean q, and no token differs by more than a quarter of the largest q.
Logits are never rounded to bf16: the replay's lm_head and JS run in fp32 (``test_bf16_replay.py``).
"""

import copy

import pytest
import torch
from peft import LoraConfig

import trl_mrtpo.relevance
from tests.conftest import needs_bf16_attention, tiny_model_of
from tests.helpers import ResearchRecordingTrainer, make_args
from tests.reference import reference_strength_betas, reference_token_advantages
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset
from trl_mrtpo.replay import replay_relevance

pytestmark = needs_bf16_attention
BF16_NOISE_FLOOR = 0.087  # benchmarks/bf16_replay.md: the largest noise floor / median signal measured (SmolLM2, if)
ARCHITECTURES = {  # (config class, the family's tie_word_embeddings as in its recipes' models)
    "llama": ("LlamaConfig", False),  # Llama-3.1-8B
    "qwen2": ("Qwen2Config", True),  # Qwen2.5-1.5B/3B-Instruct
    "qwen3": ("Qwen3Config", True),  # Qwen3-4B-Instruct-2507
}


def family_model(architecture: str, tokenizer):
    config_name, tie = ARCHITECTURES[architecture]
    return tiny_model_of(config_name, tokenizer, tie)


def bf16_run(tiny_tokenizer, tmp_path, monkeypatch, architecture, peft, mode, floor=None):
    model = family_model(architecture, tiny_tokenizer).to(torch.bfloat16)
    initial = copy.deepcopy(model)  # the weights the first replay runs with (LoRA starts as the identity)
    calls = []
    replay = trl_mrtpo.relevance.replay_relevance

    def spied(policy, contexts, completions, temperature, **kwargs):
        q = replay(policy, contexts, completions, temperature, **kwargs)
        calls.append((contexts, completions, temperature, kwargs, q))
        return q

    monkeypatch.setattr(trl_mrtpo.relevance, "replay_relevance", spied)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]) if peft else None
    trainer = ResearchRecordingTrainer(
        model=model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(
            tmp_path,
            research=True,
            bf16=True,
            per_device_train_batch_size=8,
            num_generations=4,
            credit_assignment=mode,
            reward_strength_floor=floor,
            learning_rate=1e-3,
        ),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
        peft_config=lora,
    )
    assert trainer._replay_temperature == trainer.temperature  # a plain model: its own temperature, exactly
    trainer.train()
    return trainer, initial, calls


CASES = [(a, p, "mrtpo") for a in ARCHITECTURES for p in (True, False)]
CASES += [("qwen2", True, mode) for mode in ("joint", "shuffled", "cort")]


@pytest.mark.parametrize(
    "architecture,peft,mode", CASES, ids=[f"{a}-{'lora' if p else 'full'}-{m}" for a, p, m in CASES]
)
def test_bf16_policies_train_with_exact_advantages_and_q_within_the_noise_floor(
    tiny_tokenizer, tmp_path, monkeypatch, architecture, peft, mode
):
    trainer, initial, calls = bf16_run(tiny_tokenizer, tmp_path, monkeypatch, architecture, peft, mode)
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    # q is fp32 whatever the policy's dtype (CoRT replays log-probabilities, not q)
    assert (mode == "cort") != bool(calls) and all(q.dtype == torch.float32 for *_, qs in calls for q in qs)
    # (a) the advantages from the trainer's own q, in float64
    assert any(credit.replayed.any() for credit in trainer.credits)
    for credit in trainer.credits:
        if mode == "cort":  # CoRT's weights come from a log-likelihood contrast, not q: checked in test_family.py
            continue
        expected, _ = reference_token_advantages(
            credit.rewards.double(),
            credit.relevance.double(),
            credit.mask,
            trainer.reward_weights.double(),
            credit.reward_betas,
            2.0,
            G=4,
        )
        torch.testing.assert_close(credit.advantages.double(), expected, atol=1e-5, rtol=1e-5)
    # (b) the first replay's q against fp32 arithmetic on the same rounded weights
    if mode == "cort":
        return
    contexts, completions, temperature, kwargs, q16 = calls[0]
    q32 = replay_relevance(initial.float().eval(), contexts, completions, temperature, **kwargs)
    bf, fp = torch.cat([q.flatten() for q in q16]), torch.cat([q.flatten() for q in q32])
    assert fp.mean() > 0
    assert (bf - fp).abs().mean() <= BF16_NOISE_FLOOR * fp.mean(), ((bf - fp).abs().mean(), fp.mean())
    assert (bf - fp).abs().max() <= 0.25 * fp.max()


def test_bf16_default_credit_reads_per_reward_strength_exactly(tiny_tokenizer, tmp_path, monkeypatch):
    """MRTPO's default (per-reward strength) on a bf16 Qwen2: the betas follow the float64 reference of the readings
    of the trainer's own q."""
    trainer, _, _ = bf16_run(tiny_tokenizer, tmp_path, monkeypatch, "qwen2", True, "mrtpo", floor=0.003)
    readings = [(credit.relevance, credit.replayed) for credit in trainer.credits]
    betas = reference_strength_betas(readings, [0.5, 0.5], 0.003, num_rewards=len(trainer.reward_funcs))
    for credit, expected in zip(trainer.credits, betas):
        torch.testing.assert_close(credit.reward_betas.double(), torch.tensor(expected).double(), atol=1e-6, rtol=0)


@pytest.fixture
def bf16_checkpoint(tmp_path, tiny_tokenizer):
    """A tiny Qwen2 saved in bf16, as Qwen's checkpoints are: transformers 5 loads it in bf16 by default."""
    folder = tmp_path / "qwen2-bf16"
    family_model("qwen2", tiny_tokenizer).to(torch.bfloat16).save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("arrival", ["from_pretrained", "string-with-dtype", "cli-dtype"])
def test_bf16_policies_train_whichever_way_they_arrive(bf16_checkpoint, tiny_tokenizer, tmp_path, arrival):
    """A model from ``from_pretrained`` (the checkpoint's dtype), a string id with ``dtype: bfloat16``, the CLI's
    ``--dtype bfloat16``: each trains a replaying step."""
    from transformers import AutoModelForCausalLM

    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.scripts.cli import main

    if arrival == "cli-dtype":
        main(["train", "--config", "recipes/cpu/basic-smollm2.yaml", "--model_name_or_path", bf16_checkpoint,
              "--output_dir", str(tmp_path / "out"), "--max_steps", "1", "--max_completion_length", "8",
              "--dtype", "bfloat16"])  # fmt: skip
        assert (tmp_path / "out" / "adapter_model.safetensors").exists()
        return
    model = AutoModelForCausalLM.from_pretrained(bf16_checkpoint) if arrival == "from_pretrained" else bf16_checkpoint
    init = {"model_init_kwargs": {"dtype": "bfloat16"}} if arrival == "string-with-dtype" else {}
    trainer = MRTPOTrainer(
        model=model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=1, **init),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    assert trainer.model.dtype == torch.bfloat16
    trainer.train()
    assert trainer.last_credit.replayed.any()


def test_inspect_runs_on_a_bf16_checkpoint(bf16_checkpoint, tmp_path, capsys):
    from trl_mrtpo.scripts.cli import main

    main(["inspect", "--model", bf16_checkpoint, "--num-prompts", "2", "--num-generations", "2", "--max-new-tokens",
          "6", "--output", str(tmp_path / "credit.html"), "--threads", "1"])  # fmt: skip
    assert (tmp_path / "credit.html").read_text().count('class="resp"') == 4
