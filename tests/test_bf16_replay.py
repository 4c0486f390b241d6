"""The replay in bf16, the precision users train in: the decoder runs in the model's dtype, the lm_head and JS in
fp32 (docs/kernels.md, "Precision"). The bound below is pinned against fp32 on the tiny test model; the measured
figures on SmolLM2 are in benchmarks/bf16_replay.md."""

import copy

import torch

from trl_mrtpo.ops import replay_divergence
from trl_mrtpo.replay import replay_relevance

# max |q_bf16 - q_fp32| on this batch was 1.7e-5 bits (mean 1.4e-6) against a mean q of 1.2e-3: the pin leaves 3x
BF16_MAX_ABS_ERROR = 5e-5


def replay_batch():
    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(5, 300, (n,), generator=gen).tolist()

    prompt = ids(40)
    contexts = [[prompt + ids(n) for n in sizes] for sizes in ((3, 7, 1), (3, 7, 1), (3, 2), (5, 1, 4))]
    return contexts, [ids(n) for n in (5, 9, 1, 12)]


def test_bf16_replay_stays_within_its_bound_of_fp32(tiny_model):
    contexts, completions = replay_batch()
    fp32 = tiny_model.eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    q32 = replay_relevance(fp32, contexts, completions, 0.7)
    q16 = replay_relevance(bf16, contexts, completions, 0.7)
    assert all(q.dtype == torch.float32 for q in q16)  # q itself is fp32 whatever the model's dtype
    error = torch.cat([(a - b).abs().flatten() for a, b in zip(q32, q16)])
    signal = torch.cat([a.flatten() for a in q32])
    assert error.max() <= BF16_MAX_ABS_ERROR, error.max()
    assert error.mean() <= 0.01 * signal.mean()
    assert torch.corrcoef(torch.stack([signal, torch.cat([b.flatten() for b in q16])]))[0, 1] > 0.999


def test_logits_and_js_are_fp32_from_bf16_hidden_states():
    """bf16 hidden states and lm_head give exactly the fp32 computation on their upcast values: the vocabulary-sized
    part never runs in bf16 (where two nearly equal distributions would round to the same one)."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 16, generator=gen).bfloat16()
    removed = (hidden.float() + 0.01 * torch.randn(2, 6, 16, generator=gen)).bfloat16()
    weight = torch.randn(50, 16, generator=gen).bfloat16()
    q = replay_divergence(hidden, removed, weight, None, 0.7, backend="torch")
    expected = replay_divergence(hidden.float(), removed.float(), weight.float(), None, 0.7, backend="torch")
    assert q.dtype == torch.float32
    torch.testing.assert_close(q, expected, rtol=0, atol=1e-6)  # the same fp32 sums, in vocabulary tiles


def test_the_replay_never_holds_an_fp32_copy_of_the_whole_lm_head(monkeypatch):
    """A bf16 lm_head reaches fp32 one vocabulary tile at a time (each tile twice: normalisers, then the JS terms),
    with the last tile partial; q equals the fp32 computation on the same rounded weights."""
    from trl_mrtpo.constants import VOCAB_TILE

    gen = torch.Generator().manual_seed(2)
    vocab, hidden_size = 2 * VOCAB_TILE + 37, 16
    hidden = torch.randn(5, hidden_size, generator=gen).bfloat16()
    removed = (hidden.float() + 0.05 * torch.randn(3, 5, hidden_size, generator=gen)).bfloat16()
    weight = torch.randn(vocab, hidden_size, generator=gen).bfloat16()
    bias = torch.randn(vocab, generator=gen).bfloat16()
    converted, upcast = [], torch.Tensor.float

    def spy(self, *args, **kwargs):
        if self.dtype == torch.bfloat16 and self.dim() == 2 and self.shape[1] == hidden_size:
            converted.append(self.shape[0])
        return upcast(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", spy)
    q = replay_divergence(hidden, removed, weight, bias, 0.7, backend="torch")
    monkeypatch.setattr(torch.Tensor, "float", upcast)
    assert max(converted) <= VOCAB_TILE and sum(converted) == 2 * vocab, converted
    expected = replay_divergence(hidden.float(), removed.float(), weight.float(), bias.float(), 0.7, backend="torch")
    torch.testing.assert_close(q, expected, rtol=0, atol=1e-6)
