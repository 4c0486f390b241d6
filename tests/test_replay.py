"""Lean replay: shared-prefix KV reuse and batched divergence, against independent full-logits forwards."""

import functools

import pytest
import torch

from tests.conftest import random_ids
from tests.reference import full_logits_relevance
from trl_mrtpo.replay import causal_lm_parts, context_tree, replay_path, replay_relevance


def test_context_tree_by_hand():
    # P_all = 1 2 3 4 9, P_not_a = 1 3 4 9 (span 2 removed), P_not_b = 1 2 4 9 (span 3 removed), and P_all again
    # for a second response of the group; the last token of each context stays out of the tree.
    root = context_tree([[1, 2, 3, 4, 9], [1, 3, 4, 9], [1, 2, 4, 9], [1, 2, 3, 4, 9]])
    (top,) = root.children.values()
    assert top.tokens == [1] and top.consumers() == 2 and not top.sequences
    two, three = top.children[2], top.children[3]
    assert three.tokens == [3, 4] and three.sequences == [1]
    assert two.tokens == [2] and set(two.children) == {3, 4}
    assert two.children[3].tokens == [3, 4] and two.children[3].sequences == [0, 3]  # identical contexts meet
    assert two.children[4].tokens == [4] and two.children[4].sequences == [2]
    assert context_tree([[7]]).sequences == [0]  # a one-token context is all "last token"


@pytest.fixture
def group_batch():
    """In-prompt blocks as in the instruction-following kit: a group of 3 responses to one prompt with three spans,
    each response replaying P_all and the removal of each span (identical contexts across the group), plus one
    response to another prompt."""
    gen = torch.Generator().manual_seed(1)
    parts = [random_ids(gen, n) for n in (12, 5, 9, 6, 8, 4, 10)]  # t0 s1 t1 s2 t2 s3 t3
    spans = {1, 3, 5}
    p_all = [t for part in parts for t in part]
    removed = [[t for i, part in enumerate(parts) if i != k for t in part] for k in sorted(spans)]
    contexts = [[p_all, *removed] for _ in range(3)]
    other = random_ids(gen, 30)
    contexts.append([other, other[:10] + other[15:]])
    completions = [random_ids(gen, n) for n in (6, 9, 4, 7)]
    return contexts, completions


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


def decoder_tokens(model, contexts, completions, min_shared_prefix, monkeypatch, padding: bool = False):
    """Tokens the decoder computes over a whole replay (cached positions excluded), with ``padding`` its padded
    positions too."""
    replay_path(model)  # settled first, as the trainer settles it at start-up: its probe forward is not the replay's
    decoder, _ = causal_lm_parts(model)
    original, counts = decoder.forward, []

    @functools.wraps(original)  # keeps the signature the replay reads its cache argument's name from
    def forward(*args, input_ids, attention_mask=None, **kwargs):
        mask = attention_mask[:, -input_ids.shape[1] :] if attention_mask is not None else input_ids
        # a packed row (its 4D mask) holds no padding: one packed row per forward, as wide as it is full
        counts.append(input_ids.numel() if padding or mask.dim() == 4 else int((mask != 0).sum()))
        return original(*args, input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(decoder, "forward", forward)
    replay_relevance(model, contexts, completions, 1.0, min_shared_prefix=min_shared_prefix)
    monkeypatch.undo()
    return sum(counts)


@pytest.mark.parametrize("fixture", ["batch", "group_batch"])
def test_every_shared_prefix_is_run_once(tiny_model, fixture, request, monkeypatch):
    contexts, completions = request.getfixturevalue(fixture)
    sequences = [(c, comp) for ctx, comp in zip(contexts, completions) for c in ctx]
    plain = sum(len(c) + len(comp) for c, comp in sequences)
    # Independent count: each distinct context prefix (the last context token excluded) once, then the last
    # context token and the completion of every sequence.
    distinct = {tuple(c[:n]) for c, _ in sequences for n in range(1, len(c))}
    tree = len(distinct) + sum(1 + len(comp) for _, comp in sequences)
    # What reusing only the prefix every context of a group shares (the previous replay) computes.
    groups: dict[tuple, list] = {}
    for ctx, comp in zip(contexts, completions):
        common = 0
        while common < min(len(c) for c in ctx) - 1 and all(c[common] == ctx[0][common] for c in ctx):
            common += 1
        groups.setdefault(tuple(ctx[0][:common]), []).append((ctx, comp))
    group_prefix = sum(len(key) + sum(len(c) - len(key) + len(comp) for ctx, comp in members for c in ctx)
                       for key, members in groups.items())  # fmt: skip
    assert decoder_tokens(tiny_model, contexts, completions, None, monkeypatch) == plain
    assert decoder_tokens(tiny_model, contexts, completions, 1, monkeypatch) == tree
    assert tree <= group_prefix < plain
    between = decoder_tokens(tiny_model, contexts, completions, 16, monkeypatch)
    assert tree <= between <= group_prefix
    if fixture == "group_batch":  # identical contexts across the group and nested spans: far fewer tokens
        assert tree < 0.5 * group_prefix


@pytest.mark.parametrize("min_shared_prefix", [1, 16])
def test_prefix_tree_replay_matches_full_logits_reference(tiny_model, group_batch, min_shared_prefix):
    contexts, completions = group_batch
    q = replay_relevance(
        tiny_model, contexts, completions, 0.8, batch_size=2, min_shared_prefix=min_shared_prefix, backend="torch"
    )
    for ctx, completion, got in zip(contexts, completions, q):
        expected = full_logits_relevance(tiny_model, ctx, completion, 0.8)
        torch.testing.assert_close(got.double(), expected, atol=2e-6, rtol=0)


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


def test_placed_relevance_lays_q_out_per_reward_and_zeroes_masked_positions():
    """Hand-worked: response 0 replays rewards 0 and 2 (one row each), response 1 nothing, response 2 rewards 1 and
    2; position 1 of response 0 is a tool result (mask 0). Joint: every wanted reward reads the one shared row."""
    from trl_mrtpo.replay import placed_relevance

    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1]])
    wanted = [[0, 2], [], [1, 2]]
    q = [torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]]), torch.zeros(0, 2), torch.tensor([[0.7, 0.8, 0.9]] * 2)]
    q[2][1] = torch.tensor([0.3, 0.2, 0.1])
    relevance, replayed = placed_relevance(q, wanted, mask, num_rewards=3)
    assert replayed.tolist() == [[True, False, True], [False, False, False], [False, True, True]]
    torch.testing.assert_close(relevance[0], torch.tensor([[0.1, 0.0, 0.3], [0, 0, 0], [0.4, 0.0, 0.6]]))
    assert relevance[1].abs().sum() == 0
    torch.testing.assert_close(relevance[2], torch.tensor([[0, 0, 0], [0.7, 0.8, 0.9], [0.3, 0.2, 0.1]]))
    joint, _ = placed_relevance(q, wanted, mask, num_rewards=3, joint=True)
    assert joint[2, 1].tolist() == joint[2, 2].tolist() == pytest.approx([0.7, 0.8, 0.9])
    assert joint[0, 2].tolist() == pytest.approx([0.1, 0.0, 0.3])


LOW_PRECISION = [torch.float32, torch.bfloat16, torch.float16]


def _transformed(model, transform):
    """A copy of ``model`` whose forward applies ``transform`` to the logits, undeclared by its config."""
    from transformers import LlamaForCausalLM

    class Transformed(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = transform(out.logits)
            return out

    copy = Transformed(model.config).to(model.dtype)
    copy.load_state_dict(model.state_dict())
    return copy


@pytest.mark.parametrize("dtype", LOW_PRECISION, ids=str)
def test_the_logit_probe_judges_at_the_policys_own_precision(tiny_tokenizer, dtype):
    """A plain policy in bf16 or fp16 is replayed at its own temperature (multiplier exactly 1: its logits are the
    lm_head's, rounded to its dtype); an undeclared linear scale is still found; a soft-cap ``c tanh(x / c)`` with
    |logits| near ``c`` is still refused, at every precision."""
    from tests.conftest import build_tiny_model
    from trl_mrtpo.replay import logit_multiplier

    for seed in range(3):
        model = build_tiny_model(tiny_tokenizer, seed).to(dtype)
        assert logit_multiplier(model) == 1.0
        scaled = _transformed(model, lambda logits: 2.0 * logits)
        assert logit_multiplier(scaled) == pytest.approx(2.0, rel=1e-4 if dtype == torch.float32 else 1e-2)
        with torch.no_grad():
            cap = model(input_ids=torch.tensor([[1, 2]])).logits.float().abs().max().item()
        capped = _transformed(model, lambda logits, c=cap: c * torch.tanh(logits / c))
        with pytest.raises(ValueError, match="Transformed transforms its logits non-linearly"):
            logit_multiplier(capped)


@pytest.mark.parametrize("kind", ["granite", "cohere"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_declared_logit_scale_is_read_from_the_config_in_low_precision(kind, dtype):
    """Granite's ``logits_scaling`` and Cohere's ``logit_scale`` are read from the config, exactly; the probe checks
    the forward agrees at the model's precision."""
    from trl_mrtpo.replay import logit_multiplier

    model, multiplier = _scaled_model(kind)
    assert logit_multiplier(model.to(dtype)) == multiplier


def _gemma2(tokenizer, cap: float):
    """A tiny random Gemma 2 whose ``final_logit_softcapping`` binds on its logits."""
    from tests.conftest import tiny_model_of

    model = tiny_model_of("Gemma2Config", tokenizer, True, final_logit_softcapping=cap, attn_implementation="eager")
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # logits of several units, so that a cap of 2 binds
    return model.eval()


@pytest.mark.parametrize("device_rule", [False, True], ids=["cpu-rule", "device-rule"])
def test_gemma2_is_replayed_with_its_final_logit_softcapping(batch, monkeypatch, device_rule, tiny_tokenizer):
    """Gemma 2's forward returns ``cap * tanh(z / cap)``; the replay applies the same cap before the temperature, on
    the CPU rule and the device rule alike, and q matches the model's own logits in float64."""
    from trl_mrtpo.ops import divergence
    from trl_mrtpo.replay import final_logit_softcap, logit_multiplier

    monkeypatch.setattr(divergence, "_DEVICE_RULE_ON_CPU", device_rule)
    model = _gemma2(tiny_tokenizer, cap=2.0)
    assert final_logit_softcap(model) == 2.0 and logit_multiplier(model) == 1.0
    contexts, completions = batch
    q = replay_relevance(model, contexts, completions, 0.9, backend="torch")
    for ctx, completion, got in zip(contexts, completions, q):
        torch.testing.assert_close(got.double(), full_logits_relevance(model, ctx, completion, 0.9), atol=2e-6, rtol=0)
    model.config.final_logit_softcapping = None  # the same weights replayed without the cap: a different q
    uncapped = replay_relevance(model, contexts, completions, 0.9, backend="torch")
    assert max((a - b).abs().max().item() for a, b in zip(q, uncapped) if a.numel()) > 1e-3


def test_a_gemma2_model_trains_under_mrtpo(tmp_path, tiny_tokenizer):
    from tests.helpers import RecordingTrainer, make_args
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    model = _gemma2(tiny_tokenizer, cap=2.0)
    trainer = RecordingTrainer(
        model=model,
        reward_funcs=BASIC.rewards,
        info_blocks=BASIC.info_blocks,
        args=make_args(tmp_path, max_steps=1),
        train_dataset=make_basic_dataset(4),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    assert trainer.replays and trainer.replays[0]["replayed"].any()
    assert torch.isfinite(trainer.batches[0]["advantages"]).all()
