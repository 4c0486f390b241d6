"""Lean replay: shared-prefix KV reuse and batched divergence, against independent full-logits forwards."""

import math

import pytest
import torch

from trl_mrtpo.replay import causal_lm_parts, replay_relevance, shared_prefix_length


def random_ids(gen, n):
    return torch.randint(5, 300, (n,), generator=gen).tolist()


def full_logits_relevance(model, contexts, completion, temperature):
    """q by hand: one plain forward per context, full logits, textbook JS in float64."""
    with torch.no_grad():
        logprobs = []
        for ctx in contexts:
            logits = model(torch.tensor([ctx + completion])).logits[0, len(ctx) - 1 : len(ctx) - 1 + len(completion)]
            logprobs.append(torch.log_softmax(logits.double() / temperature, -1))
    p = logprobs[0].exp()
    rows = []
    for lq in logprobs[1:]:
        q = lq.exp()
        m = 0.5 * (p + q)
        rows.append((0.5 * (p * (logprobs[0] - m.log())).sum(-1) + 0.5 * (q * (lq - m.log())).sum(-1)) / math.log(2))
    return torch.stack(rows)


@pytest.fixture
def batch():
    """Two groups: four responses to one 40-token prompt (2 or 3 contexts each), one to another prompt."""
    gen = torch.Generator().manual_seed(0)
    prompt, other = random_ids(gen, 40), random_ids(gen, 30)
    contexts = [[prompt + random_ids(gen, n) for n in sizes] for sizes in ((3, 7, 1), (3, 7, 1), (3, 2), (5, 1, 4))]
    contexts.append([other + random_ids(gen, 6), other + random_ids(gen, 2)])
    completions = [random_ids(gen, n) for n in (5, 9, 1, 12, 7)]
    return contexts, completions


def test_shared_prefix_length():
    assert shared_prefix_length([[1, 2, 3, 4], [1, 2, 5]]) == 2
    # the last context token's state predicts the first completion token: it always stays in the suffix
    assert shared_prefix_length([[1, 2, 3], [1, 2, 3]]) == 2
    assert shared_prefix_length([[7], [7, 8]]) == 0
    assert shared_prefix_length([[1, 2], [3, 2]]) == 0


@pytest.mark.parametrize("min_shared_prefix", [None, 16])
def test_replay_matches_full_logits_reference(tiny_model, batch, min_shared_prefix):
    contexts, completions = batch
    q = replay_relevance(
        tiny_model, contexts, completions, 0.9, batch_size=3, min_shared_prefix=min_shared_prefix, backend="torch"
    )
    for ctx, completion, got in zip(contexts, completions, q):
        assert got.shape == (len(ctx) - 1, len(completion))
        expected = full_logits_relevance(tiny_model, ctx, completion, 0.9)
        torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=0)


def test_shared_prefix_is_run_once(tiny_model, batch, monkeypatch):
    contexts, completions = batch
    decoder, _ = causal_lm_parts(tiny_model)
    original = decoder.forward

    def new_tokens(min_shared_prefix):
        """Tokens the decoder computes (cached prefix positions excluded), over the whole replay."""
        counts = []

        def forward(*args, input_ids, attention_mask=None, **kwargs):
            mask = attention_mask[:, -input_ids.shape[1] :] if attention_mask is not None else input_ids
            counts.append(int((mask != 0).sum()))
            return original(*args, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

        monkeypatch.setattr(decoder, "forward", forward)
        replay_relevance(tiny_model, contexts, completions, 1.0, min_shared_prefix=min_shared_prefix)
        monkeypatch.undo()
        return sum(counts)

    plain = sum(len(c) + len(comp) for ctx, comp in zip(contexts, completions) for c in ctx)
    assert new_tokens(None) == plain
    # 11 sequences share the 40-token prompt and 2 the 30-token one: each prefix is computed once.
    assert new_tokens(16) == plain - 10 * 40 - 1 * 30
    assert new_tokens(41) == plain  # no prefix that long: no reuse


def _scaled_model(kind):
    """Tiny random models whose forward scales the logits: Granite divides by logits_scaling, Cohere multiplies
    by logit_scale."""
    common = dict(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    if kind == "granite":
        from transformers import GraniteConfig, GraniteForCausalLM

        return GraniteForCausalLM(GraniteConfig(logits_scaling=4.0, **common)).eval(), 0.25
    from transformers import CohereConfig, CohereForCausalLM

    return CohereForCausalLM(CohereConfig(logit_scale=3.0, tie_word_embeddings=False, **common)).eval(), 3.0


@pytest.mark.parametrize("kind", ["granite", "cohere"])
def test_models_that_scale_logits_in_forward_are_replayed_at_their_temperature(batch, kind):
    from trl_mrtpo.replay import logit_multiplier

    model, multiplier = _scaled_model(kind)
    assert logit_multiplier(model) == pytest.approx(multiplier, rel=1e-4)
    contexts, completions = batch
    q = replay_relevance(model, contexts, completions, 0.9 / logit_multiplier(model), backend="torch")
    for ctx, completion, got in zip(contexts, completions, q):
        torch.testing.assert_close(got.double(), full_logits_relevance(model, ctx, completion, 0.9), atol=2e-6, rtol=0)


def test_non_linear_logit_transform_is_refused(tiny_tokenizer):
    from transformers import LlamaForCausalLM

    from tests.conftest import build_tiny_model
    from trl_mrtpo.replay import logit_multiplier

    class SoftCapped(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = 0.05 * torch.tanh(out.logits / 0.05)
            return out

    model = build_tiny_model(tiny_tokenizer)
    capped = SoftCapped(model.config)
    capped.load_state_dict(model.state_dict())
    assert logit_multiplier(model) == pytest.approx(1.0, rel=1e-6)
    with pytest.raises(ValueError, match="SoftCapped transforms its logits non-linearly"):
        logit_multiplier(capped)


def test_trainer_replays_a_granite_model_at_the_scaled_temperature(tmp_path, tiny_tokenizer):
    from trl_mrtpo import MRTPOConfig, MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    model, multiplier = _scaled_model("granite")
    model.resize_token_embeddings(len(tiny_tokenizer))
    trainer = MRTPOTrainer(
        model=model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=MRTPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", temperature=0.8),
        train_dataset=make_basic_dataset(8),
        processing_class=tiny_tokenizer,
    )
    assert trainer._replay_temperature == pytest.approx(0.8 / multiplier, rel=1e-4)
