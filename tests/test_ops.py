"""The JS op against a float64 reference and its invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.reference import js_float64
from trl_mrtpo.ops import js_divergence, replay_divergence


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(2, 300), st.floats(0.1, 8.0))
def test_matches_float64_reference(seed, vocab, scale):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(5, vocab, generator=gen) * scale
    b = torch.randn(5, vocab, generator=gen) * scale
    got = js_divergence(a.log_softmax(-1), b.log_softmax(-1))
    torch.testing.assert_close(got.double(), js_float64(a, b), atol=1e-6, rtol=0)
    torch.testing.assert_close(got, js_divergence(b.log_softmax(-1), a.log_softmax(-1)), atol=1e-7, rtol=0)
    assert ((got >= 0) & (got <= 1)).all()


def test_identical_inputs_give_exactly_zero():
    logits = torch.randn(64, 49152) * 3
    lp = logits.log_softmax(-1)
    assert js_divergence(lp, lp.clone()).abs().max().item() == 0.0


def test_disjoint_supports_give_one_bit():
    lp = torch.tensor([[0.0, -math.inf, -math.inf]])
    lq = torch.tensor([[-math.inf, 0.0, -math.inf]])
    assert js_divergence(lp, lq).item() == pytest.approx(1.0, abs=1e-6)
    assert js_divergence(lp, lp).item() == 0.0


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 64])
def test_replay_divergence_equals_full_logits(chunk_size):
    gen = torch.Generator().manual_seed(0)
    hidden_all = torch.randn(7, 16, generator=gen)
    hidden_removed = torch.randn(3, 7, 16, generator=gen)
    hidden_removed[1] = hidden_all  # an identical context must give exactly 0
    weight = torch.randn(50, 16, generator=gen)
    bias = torch.randn(50, generator=gen)
    q = replay_divergence(hidden_all, hidden_removed, weight, bias, temperature=0.7, chunk_size=chunk_size)
    assert q.shape == (3, 7) and q.dtype == torch.float32
    for m in range(3):
        expected = js_float64((hidden_all @ weight.T + bias) / 0.7, (hidden_removed[m] @ weight.T + bias) / 0.7)
        torch.testing.assert_close(q[m].double(), expected, atol=1e-6, rtol=0)
    assert q[1].abs().max().item() == 0.0


def test_replay_divergence_upcasts_half_precision_inputs():
    gen = torch.Generator().manual_seed(0)
    hidden_all = torch.randn(4, 8, generator=gen).bfloat16()
    hidden_removed = torch.randn(2, 4, 8, generator=gen).bfloat16()
    weight = torch.randn(20, 8, generator=gen).bfloat16()
    q = replay_divergence(hidden_all, hidden_removed, weight)
    expected = torch.stack(
        [js_float64(hidden_all.double() @ weight.double().T, h.double() @ weight.double().T) for h in hidden_removed]
    )
    torch.testing.assert_close(q.double(), expected, atol=1e-6, rtol=0)


def test_replay_divergence_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="hidden_removed"):
        replay_divergence(torch.zeros(4, 8), torch.zeros(4, 8), torch.zeros(10, 8))
    with pytest.raises(ValueError, match="temperature"):
        replay_divergence(torch.zeros(4, 8), torch.zeros(1, 4, 8), torch.zeros(10, 8), temperature=0.0)


@pytest.mark.parametrize("backend, expected", [("auto", "torch"), ("torch", "torch"), ("triton", "triton")])
def test_auto_is_torch_until_the_kernel_has_passed_on_a_gpu(backend, expected, monkeypatch):
    """One decision on every process and device: ``auto`` never picks the kernel, even on CUDA with Triton."""
    from trl_mrtpo.ops import divergence, triton_divergence

    monkeypatch.setattr(triton_divergence, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert divergence.chosen_backend(backend) == expected


def test_the_kernel_backend_is_checked_at_start_up_and_runs_the_replay(
    tiny_model, tiny_tokenizer, tmp_path, monkeypatch
):
    """``divergence_backend="triton"`` (here a stand-in wrapping the torch path for the kernel's backend): its
    start-up check sees the real lm_head once, every replay runs it, and the advantages are the torch path's (bit
    for bit); a backend that cannot run here is refused at construction with its own words; no other name is
    taken (the backend is a choice, not a registry)."""
    import trl_mrtpo.ops.triton_divergence as triton_module
    from tests.helpers import RecordingTrainer, make_args
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset
    from trl_mrtpo.ops.divergence import DivergenceBackend, stacked_divergence

    checked, computed = [], []

    def compute(stacked, weight, bias, temperature, softcap, chunk_size, chunk_rows):
        computed.append(stacked.shape[1] - 1)
        return stacked_divergence(stacked, weight, bias, temperature, chunk_size, "torch", softcap, chunk_rows)

    def train(backend):
        torch.manual_seed(0)
        trainer = RecordingTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path / backend, divergence_backend=backend, max_steps=1, seed=3),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )
        trainer.train()
        return trainer.batches[0]["advantages"]

    initial = {name: p.detach().clone() for name, p in tiny_model.named_parameters()}
    # the kernel's backend stood in for by one that wraps the torch path
    monkeypatch.setattr(triton_module, "BACKEND", DivergenceBackend(compute, check=lambda *args: checked.append(args)))
    advantages = train("triton")
    assert len(checked) == 1 and checked[0][0].shape == tiny_model.lm_head.weight.shape
    with_blocks = sum(builder is not None for builder in BASIC.info_blocks)
    assert computed and all(count == with_blocks for count in computed)
    with torch.no_grad():
        for name, p in tiny_model.named_parameters():
            p.copy_(initial[name])
    assert torch.equal(advantages, train("torch"))
    monkeypatch.setattr(triton_module, "BACKEND", DivergenceBackend(compute, missing=lambda: "needs the absent extra"))
    with pytest.raises(ValueError, match="divergence_backend='triton' needs the absent extra"):
        train("triton")  # refused where the trainer resolves its settings, before the model is touched
    with pytest.raises(ValueError, match="divergence_backend must be one of auto, torch, triton, got 'wrapped'"):
        make_args(tmp_path, divergence_backend="wrapped")
