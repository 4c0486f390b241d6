"""The replay packs the sequences of one context side by side in one row: no padded position is computed, the prefix
cache is shared without copies, and q equals the float64 reference of one plain forward per context for the
families the recipes train (Llama, Qwen2, Qwen3, Gemma 2 with its softcap and sliding window) through SDPA and eager
attention; in bf16 the packed states agree with one sequence per row within bf16's rounding."""

import pytest
import torch

from tests.conftest import random_ids, tiny_model_of
from tests.reference import full_logits_relevance
from tests.test_replay import decoder_tokens
from trl_mrtpo.replay import (
    _Decoder,
    completion_hidden_states,
    packed_mask,
    packed_rows,
    replay_path,
    replay_relevance,
    shared_cache,
)


@pytest.fixture
def uneven_batch():
    """Two prompts of a group of four responses each, completions of 3 to 40 tokens, each response replaying P_all
    and two contexts without an appended block (so the responses of a prompt share their contexts)."""
    gen = torch.Generator().manual_seed(3)
    contexts, completions = [], []
    for _ in range(2):
        prompt, first, second = random_ids(gen, 20), random_ids(gen, 6), random_ids(gen, 5)
        group = [prompt + first + second, prompt + second, prompt + first]
        for length in torch.randint(3, 41, (4,), generator=gen).tolist():
            contexts.append(group)
            completions.append(random_ids(gen, length))
    return contexts, completions


def needed_positions(contexts, completions) -> int:
    """Counted independently: each distinct context prefix (its last token excluded) once, then the last context
    token and the completion of every sequence."""
    sequences = [(c, comp) for ctx, comp in zip(contexts, completions) for c in ctx]
    distinct = {tuple(c[:n]) for c, _ in sequences for n in range(1, len(c))}
    return len(distinct) + sum(1 + len(comp) for _, comp in sequences)


def test_packed_rows_and_mask_by_hand():
    assert packed_rows([10, 3, 7, 6, 4], 10) == [[0], [1, 2], [3, 4]]
    assert packed_rows([12, 3], 10) == [[0], [1]]  # a sequence longer than the row stands alone
    # one row: a prefix of 2 cached tokens, then sequences of 2 and 1 tokens
    mask = packed_mask([2, 1], cached=2)
    assert mask.shape == (1, 1, 3, 5) and mask[0, 0].int().tolist() == [
        [1, 1, 1, 0, 0],  # first sequence, token 0: the prefix and itself
        [1, 1, 1, 1, 0],  # token 1: the prefix, token 0, itself
        [1, 1, 0, 0, 1],  # second sequence: the prefix and itself, not the first sequence
    ]
    for dtype in (torch.float32, torch.bfloat16):  # in the model's dtype: eager bf16 attention adds it to bf16
        additive = packed_mask([2, 1], cached=2, additive=dtype)
        assert additive.dtype == dtype and ((additive == 0) == mask).all()
        assert (additive[~mask] == torch.finfo(dtype).min).all()


@pytest.mark.parametrize("min_shared_prefix", [1, 16])
def test_the_replay_computes_at_most_five_percent_more_positions_than_it_needs(
    tiny_model, uneven_batch, monkeypatch, min_shared_prefix
):
    contexts, completions = uneven_batch
    needed = needed_positions(contexts, completions)
    computed = decoder_tokens(tiny_model, contexts, completions, min_shared_prefix, monkeypatch, padding=True)
    if min_shared_prefix == 1:
        assert needed <= computed <= 1.05 * needed, (computed, needed)
    # one sequence per row (the path a model without a custom mask takes) pads to the longest of each forward
    monkeypatch.setattr(_Decoder, "packs", lambda self, cached, width: False)
    padded = decoder_tokens(tiny_model, contexts, completions, min_shared_prefix, monkeypatch, padding=True)
    assert computed < padded and padded > 1.2 * needed, (computed, padded, needed)


def family(name: str, tokenizer, attention: str, **fields):
    config = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gemma2": "Gemma2Config"}[name]
    tied = name != "llama"
    model = tiny_model_of(config, tokenizer, tied, attn_implementation=attention, **fields)
    return model.eval()


@pytest.mark.parametrize(
    "name, attention, fields",
    [
        ("llama", "sdpa", {}),
        ("llama", "eager", {}),
        ("qwen2", "sdpa", {}),
        ("qwen3", "sdpa", {}),
        ("gemma2", "eager", {"final_logit_softcapping": 30.0, "sliding_window": 4096}),
        ("gemma2", "eager", {"sliding_window": 48}),  # contexts + completions pass the window: rows are not packed
    ],
    ids=["llama-sdpa", "llama-eager", "qwen2-sdpa", "qwen3-sdpa", "gemma2-eager", "gemma2-past-window"],
)
def test_packed_q_matches_one_plain_forward_per_context_in_float64(tiny_tokenizer, uneven_batch, name, attention,
                                                                    fields):  # fmt: skip
    model = family(name, tiny_tokenizer, attention, **fields)
    contexts, completions = uneven_batch
    q = replay_relevance(model, contexts, completions, 0.9, batch_size=3, min_shared_prefix=1, backend="torch")
    for ctx, completion, got in zip(contexts, completions, q):
        torch.testing.assert_close(got.double(), full_logits_relevance(model, ctx, completion, 0.9), atol=2e-6, rtol=0)


def test_packed_bf16_states_agree_with_one_sequence_per_row_within_bf16_rounding(tiny_tokenizer, uneven_batch):
    model = family("qwen2", tiny_tokenizer, "sdpa").to(torch.bfloat16)
    contexts, completions = uneven_batch
    flat = [(c, comp) for ctx, comp in zip(contexts, completions) for c in ctx]
    alls, owned = [c for c, _ in flat], [comp for _, comp in flat]
    packed = completion_hidden_states(model, alls, owned, batch_size=8, min_shared_prefix=1)
    alone = completion_hidden_states(model, alls, owned, batch_size=1, min_shared_prefix=None)
    for a, b in zip(packed, alone):
        # bf16 keeps 8 bits: two summation orders of the same states differ by a few of its units
        torch.testing.assert_close(a.float(), b.float(), atol=0.05, rtol=2**-6)


def test_a_prefix_cache_is_shared_without_a_copy_and_left_as_it_was(tiny_model):
    decoder = _Decoder(tiny_model, replay_path(tiny_model))
    prefix = list(range(3, 15))
    with torch.no_grad():
        cache = decoder.extend(None, 0, prefix)
        keys = [layer.keys for layer in cache.layers]
        before = [k.clone() for k in keys]
        shared = shared_cache(cache, 3)
        assert all(s.keys.data_ptr() == k.data_ptr() and s.keys.shape[0] == 3 for s, k in zip(shared.layers, keys))
        decoder.hidden(cache, len(prefix), [[20, 21, 22], [23, 24], [25]], packed=True)
        decoder.hidden(cache, len(prefix), [[20, 21, 22], [23, 24], [25]])
        child = decoder.extend(cache, len(prefix), [30, 31])
    assert [layer.keys for layer in cache.layers] == keys and all(torch.equal(k, b) for k, b in zip(keys, before))
    assert child.get_seq_length() == len(prefix) + 2 and cache.get_seq_length() == len(prefix)
