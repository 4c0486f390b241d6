"""The vLLM path on CPU: TRL's vLLM generation replaced by a stand-in that returns sampled ids and log-probs that
deliberately differ from the policy's. MRTPO trains through TRL's importance-sampling correction (on by default),
with LoRA: the token advantages equal the float64 reference and the correction reaches the loss."""

import pytest
import torch
from peft import LoraConfig

from tests.helpers import ResearchRecordingTrainer, graded_length, make_args
from tests.reference import reference_token_advantages
from trl_mrtpo.kits.basic import KIT as BASIC
from trl_mrtpo.kits.basic import make_basic_dataset


class StandInVLLM:
    """What ``trl.generation.vllm_generation.VLLMGeneration`` gives the trainer: one completion per prompt row and the
    sampled tokens' log-probabilities, here drawn at random and set off the policy's (a sampler that is not the
    trained model, as vLLM's kernels and precision make it)."""

    created: list["StandInVLLM"] = []

    def __init__(self, model, accelerator, processing_class, max_completion_length, **_):
        self.vocab = len(processing_class)
        self.eos = processing_class.eos_token_id
        self.max_completion_length = max_completion_length
        self.generator = torch.Generator().manual_seed(0)
        self.synced = 0
        self.sampled_logprobs: list[list[float]] = []
        StandInVLLM.created.append(self)

    def sync_weights(self):
        self.synced += 1

    def generate(self, prompts, images, num_generations, profiler=None):
        completions, logprobs = [], []
        for _ in prompts:
            length = int(torch.randint(2, self.max_completion_length, (1,), generator=self.generator))
            ids = torch.randint(5, self.vocab, (length,), generator=self.generator).tolist() + [self.eos]
            values = (-6.0 + 0.2 * torch.randn(len(ids), generator=self.generator)).tolist()  # near a random policy's
            completions.append(ids)
            logprobs.append([[value] for value in values])
            self.sampled_logprobs.append(values)
        return prompts, completions, logprobs, None


@pytest.fixture
def stand_in(monkeypatch):
    import trl.trainer.grpo_trainer as grpo

    StandInVLLM.created.clear()
    monkeypatch.setattr(grpo, "VLLMGeneration", StandInVLLM)
    return StandInVLLM


def test_mrtpo_through_the_vllm_path_with_importance_correction_and_lora(
    tiny_model, tiny_tokenizer, tmp_path, stand_in
):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = ResearchRecordingTrainer(
        model=tiny_model,
        reward_funcs=[graded_length, *BASIC.rewards],
        info_blocks=[lambda **_: "Be long.", *BASIC.info_blocks],
        args=make_args(
            tmp_path,
            research=True,
            max_steps=2,
            per_device_train_batch_size=8,
            num_generations=4,
            use_vllm=True,
            vllm_mode="colocate",
        ),
        train_dataset=make_basic_dataset(16),
        processing_class=tiny_tokenizer,
        peft_config=lora,
    )
    assert trainer.vllm_importance_sampling_correction  # TRL's default
    trainer.train()
    (engine,) = stand_in.created
    assert engine.synced == 2  # LoRA weights pushed before each step's generation
    for credit, batch in zip(trainer.credits, trainer.batches):
        # the token advantages: steps 1-8 in float64 from the rewards and q, as without vLLM
        expected, _ = reference_token_advantages(
            credit.rewards.double(),
            credit.relevance.double(),
            credit.mask,
            trainer.reward_weights.double(),
            0.5,
            2.0,
            G=4,
        )
        torch.testing.assert_close(credit.advantages.double(), expected, atol=2e-5, rtol=2e-5)
        assert credit.replayed.any()
        # the sampler's log-probs reached TRL, and its correction (TRL's default: one ratio per sequence, masked to 0
        # above 3) is what the policy's and the sampler's log-probs make it
        mask = batch["completion_mask"]
        ratio = batch["importance_sampling_ratio"]
        gap = ((batch["old_per_token_logps"] - batch["sampling_per_token_logps"]) * mask).sum(-1, keepdim=True)
        expected_ratio = torch.where(gap.exp() > trainer.vllm_importance_sampling_clip_max, 0.0, gap.exp())
        torch.testing.assert_close(ratio, expected_ratio)
        assert (ratio != 1).all()
    # the correction reaches the loss: the same batch with a ratio of 1 gives another loss
    batch = dict(trainer.batches[-1])
    trainer.current_gradient_accumulation_steps = 1
    with torch.no_grad():
        corrected = trainer._compute_loss(trainer.model, batch)
        uncorrected = trainer._compute_loss(
            trainer.model, {**batch, "importance_sampling_ratio": torch.ones_like(batch["importance_sampling_ratio"])}
        )
    assert not torch.isclose(corrected, uncorrected)


class StandInServer:
    """What TRL asks a vLLM server at start-up (its log-probability mode)."""

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}}
