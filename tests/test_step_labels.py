"""Where step scores come from: a process reward model built in the test, and Math-Shepherd rollouts from a tiny
policy; then a process reward end to end on the embedded model."""

import pytest
import torch

from tests.helpers import build_prm
from trl_mrtpo import MRTPOConfig, MRTPOTrainer
from trl_mrtpo.steps.process_rewards import step_spans
from trl_mrtpo.steps.step_labels import MathShepherd, ProcessRewardModel


def trl_prm_row(tokenizer, prompt, steps, separator):
    """TRL's former ``PRMTrainer.tokenize_row``, by hand: BOS, the prompt without special tokens, each step plus the
    separator; the label on the last token of each step's separator."""
    ids = [tokenizer.bos_token_id] + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    positions = []
    for text in steps:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + tokenizer.encode(
            separator, add_special_tokens=False
        )
        positions.append(len(ids) - 1)
    return ids, positions


@pytest.fixture
def bos_tokenizer(tiny_tokenizer):
    """The tiny tokenizer with a BOS token (as most PRMs' tokenizers have)."""
    import copy

    tokenizer = copy.deepcopy(tiny_tokenizer)
    tokenizer.bos_token = "<|system|>"
    return tokenizer


def test_prm_input_is_trls_prm_format(bos_tokenizer, tmp_path):
    prm = ProcessRewardModel(build_prm(bos_tokenizer, tmp_path / "prm"), step_separator="\n", batch_size=2)
    prompts = ["Write SQL.", "Call the tool.", "Write a poem."]
    steps = [["SELECT name", "FROM users"], ["get_weather"], ["The sea", "the sky", "the fox"]]
    seen = []
    prm.model.register_forward_pre_hook(lambda _, args, kwargs: seen.append(kwargs["input_ids"]), with_kwargs=True)
    scores = prm.score_steps(prompts, steps)
    first_batch = seen[0]
    for row, (prompt, texts) in enumerate(zip(prompts[:2], steps[:2])):
        ids, _ = trl_prm_row(bos_tokenizer, prompt, texts, "\n")
        assert first_batch[row, : len(ids)].tolist() == ids  # the very ids PRMTrainer trained on
    for prompt, texts, got in zip(prompts, steps, scores):
        ids, positions = trl_prm_row(bos_tokenizer, prompt, texts, "\n")
        with torch.no_grad():
            logits = prm.model(input_ids=torch.tensor([ids])).logits[0]
        expected = logits.softmax(-1)[positions, 1]
        torch.testing.assert_close(torch.tensor(got), expected, atol=1e-5, rtol=1e-4)
    # batching (right padding) changes nothing
    one_by_one = ProcessRewardModel(prm.model, bos_tokenizer, batch_size=1).score_steps(prompts, steps)
    torch.testing.assert_close(torch.tensor(sum(one_by_one, [])), torch.tensor(sum(scores, [])))


def test_a_prm_that_is_not_a_step_classifier_is_refused(tiny_model, tiny_tokenizer, tmp_path):
    with pytest.raises(TypeError, match="token-classification model.*LlamaForCausalLM"):
        ProcessRewardModel(tiny_model, tiny_tokenizer)
    classifier = build_prm(tiny_tokenizer, tmp_path / "prm")
    with pytest.raises(ValueError, match="positive_label=2 is not one of the PRM's 2 labels"):
        ProcessRewardModel(classifier, positive_label=2)
    for separator in ("", None):
        with pytest.raises(ValueError, match="step_separator must be non-empty text"):
            ProcessRewardModel(classifier, step_separator=separator)
        with pytest.raises(ValueError, match="step_separator must be non-empty text"):
            MathShepherd(lambda *_: 1.0, step_separator=separator)
    with pytest.raises(ValueError, match="non-empty separator"):
        step_spans("a\nb", "")


def test_prm_as_a_process_reward_returns_the_steps_spans(tiny_tokenizer, tmp_path):
    prm = ProcessRewardModel(build_prm(tiny_tokenizer, tmp_path / "prm"), name="tiny_prm")
    text = "The sea\n\nthe sky"
    (steps,) = prm(prompts=[[{"role": "user", "content": "Write a poem."}]], completions=[[{"content": text}]])
    assert [(s.start, s.end) for s in steps] == step_spans(text) == [(0, 7), (9, 16)]
    assert all(0.0 < s.score < 1.0 for s in steps) and prm.__name__ == "tiny_prm"
    with pytest.raises(ValueError, match="needs the PRM's tokenizer"):
        ProcessRewardModel(prm.model)


class CountingModel(torch.nn.Module):
    """Wraps a policy and counts the continuations it is asked to sample."""

    def __init__(self, model):
        super().__init__()
        self.model, self.sampled = model, 0

    def generate(self, **kwargs):
        self.sampled += kwargs["input_ids"].shape[0] * kwargs["num_return_sequences"]
        return self.model.generate(**kwargs)


@pytest.mark.parametrize("label", ["soft", "hard"])
def test_math_shepherd_labels_and_cost(tiny_model, tiny_tokenizer, label):
    policy = CountingModel(tiny_model)
    texts = ["The sea is blue.\nThe sky is red.\nThe fox jumps.", "One step only."]
    prompts = [[{"role": "user", "content": "Write."}]] * 2

    def starts_right(prompt, completion, row):  # true of every continuation of a prefix that starts right
        return completion.startswith("The sea")

    shepherd = MathShepherd(starts_right, num_rollouts=3, label=label, model=policy, tokenizer=tiny_tokenizer,
                            max_new_tokens=40, batch_size=1)  # fmt: skip
    labels = shepherd.label(prompts, texts)
    assert [[(s.start, s.end) for s in steps] for steps in labels] == [step_spans(t) for t in texts]
    assert [[s.score for s in steps] for steps in labels] == [[1.0, 1.0, 1.0], [0.0]]
    assert policy.sampled == 3 * (3 - 1)  # num_rollouts x (S - 1); a one-step response needs none

    def coin(prompt, completion, row):  # a continuation is right when its length is even
        return len(completion) % 2 == 0

    soft = MathShepherd(coin, num_rollouts=4, label=label, model=policy, tokenizer=tiny_tokenizer, max_new_tokens=40)
    (steps,) = soft.label(prompts[:1], texts[:1])
    allowed = {0.0, 0.25, 0.5, 0.75, 1.0} if label == "soft" else {0.0, 1.0}
    assert all(s.score in allowed for s in steps)
    assert steps[-1].score == float(coin(None, texts[0], None))  # the last step: the response's own verdict


def test_math_shepherd_needs_a_policy():
    with pytest.raises(RuntimeError, match="use it with MRTPOTrainer"):
        MathShepherd(lambda *a: True).label(["p"], ["a\nb"])
    with pytest.raises(ValueError, match="label must be"):
        MathShepherd(lambda *a: True, label="medium")


@pytest.mark.slow
def test_process_reward_from_a_small_prm_on_the_embedded_model(tmp_path):
    pytest.importorskip("gguf")
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer

    from trl_mrtpo.scripts.embedded import embedded_model_path

    path = embedded_model_path()
    prm = ProcessRewardModel(build_prm(AutoTokenizer.from_pretrained(path), tmp_path / "prm"), step_separator=" ")

    def words(completions, **_):
        return [float(len(c[0]["content"].split()) > 3) for c in completions]

    prompts = [[{"role": "user", "content": f"Name {n} fruits."}] for n in ("two", "three")]
    trainer = MRTPOTrainer(
        model=path,
        reward_funcs=[words],
        process_rewards=[prm],
        args=MRTPOConfig(
            output_dir=str(tmp_path / "out"), credit_assignment="gdpo", max_steps=1, per_device_train_batch_size=4,
            num_generations=4, max_completion_length=12, use_cpu=True, bf16=False, report_to="none",
            save_strategy="no", logging_steps=1, seed=0,
        ),
        train_dataset=Dataset.from_list([{"prompt": p} for p in prompts * 2]),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    trainer.train()
    record = trainer.last_credit
    assert 0.0 < trainer.state.log_history[0]["mrtpo/term/process/prm"] < 1.0
    assert torch.isfinite(record.advantages).all()
    # process credit varies along a response (GDPO's outcome credit alone is uniform)
    varying = [row[m.bool()].unique().numel() > 1 for row, m in zip(record.advantages, record.mask) if m.sum() > 1]
    assert any(varying)
