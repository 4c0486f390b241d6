"""The fused Triton kernel against the torch path and float64, on CPU under TRITON_INTERPRET=1 (or on a GPU).

Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when `trl_mrtpo.ops` is first imported; other test
modules import it first, so on a machine without CUDA this module re-runs itself in a subprocess with the
interpreter on.
"""

import os
import subprocess
import sys

import pytest
import torch

from tests.reference import js_float64
from trl_mrtpo.ops import replay_divergence, triton_divergence

pytestmark = pytest.mark.skipif(not triton_divergence.is_available(), reason="Triton is not installed")
RUNS_KERNELS = triton_divergence.interpreting() or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not triton_divergence.interpreting() else "cpu"
needs_kernels = pytest.mark.skipif(not RUNS_KERNELS, reason="runs in the interpreter subprocess")

if triton_divergence.is_available():
    import triton
    import triton.language as tl

    from trl_mrtpo.ops.triton_divergence import _row_offsets

    @triton.jit
    def _offsets_probe(out_ptr, start, stride, BLOCK: tl.constexpr):
        rows = start + tl.arange(0, BLOCK)  # int32 row indices, as in the kernels
        tl.store(out_ptr + tl.arange(0, BLOCK), _row_offsets(rows, stride))


@needs_kernels
@pytest.mark.parametrize(("start", "stride"), [(2**20, 4096), (630_000, 3584), (7, 576)])
def test_row_offsets_do_not_wrap_at_32_bits(start, stride):
    """Offsets of rows whose element offset passes 2^31 (e.g. 7 contexts x 90k tokens x H=3584)."""
    out = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    _offsets_probe[(1,)](out, start, stride, BLOCK=8)
    assert out.tolist() == [(start + i) * stride for i in range(8)]


@needs_kernels
def test_strided_lm_head_is_read_by_its_stride():
    hidden_all, hidden_removed, weight, bias = inputs(2, 9, 16, 70)
    wide = torch.zeros(70, 40, device=DEVICE)
    wide[:, :16] = weight
    strided = wide[:, :16]  # row stride 40, not 16: addressed in place, no copy
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        triton_divergence.fused_replay_divergence(hidden_all, hidden_removed, strided, bias),
        triton_divergence.fused_replay_divergence(hidden_all, hidden_removed, weight, bias),
    )


@pytest.mark.skipif(RUNS_KERNELS, reason="kernels run directly here")
def test_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " skipped" in result.stdout  # the kernel tests ran, this one skipped


def inputs(num_removed, tokens, hidden, vocab, dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden_all = torch.randn(tokens, hidden, generator=gen)
    hidden_removed = torch.randn(num_removed, tokens, hidden, generator=gen) * 0.5 + hidden_all * 0.5
    weight = torch.randn(vocab, hidden, generator=gen) / hidden**0.25
    bias_ = torch.randn(vocab, generator=gen) if bias else None
    move = {"device": DEVICE, "dtype": dtype}
    return (
        hidden_all.to(**move),
        hidden_removed.to(**move),
        weight.to(**move),
        None if bias_ is None else bias_.to(**move),
    )


@needs_kernels
@pytest.mark.parametrize(
    ("num_removed", "tokens", "hidden", "vocab", "bias", "temperature"),
    [(1, 5, 16, 50, False, 1.0), (3, 19, 40, 300, True, 0.7), (8, 33, 24, 130, True, 1.3)],
)
def test_matches_float64_and_torch_path(num_removed, tokens, hidden, vocab, bias, temperature):
    """Tokens, hidden size and vocabulary that are not multiples of the blocks; K in {1, 3, 8}."""
    hidden_all, hidden_removed, weight, bias_ = inputs(num_removed, tokens, hidden, vocab, bias=bias)
    hidden_removed[-1] = hidden_all  # an identical context
    q = replay_divergence(hidden_all, hidden_removed, weight, bias_, temperature, backend="triton")
    assert q.shape == (num_removed, tokens) and q.dtype == torch.float32
    for m in range(num_removed):
        logits_all = hidden_all.double() @ weight.double().T + (0 if bias_ is None else bias_.double())
        logits = hidden_removed[m].double() @ weight.double().T + (0 if bias_ is None else bias_.double())
        expected = js_float64(logits_all / temperature, logits / temperature)
        torch.testing.assert_close(q[m].double().cpu(), expected.cpu(), atol=2e-6, rtol=0)
    assert q[-1].abs().max().item() < 1e-6
    torch_path = replay_divergence(hidden_all, hidden_removed, weight, bias_, temperature, backend="torch")
    torch.testing.assert_close(q, torch_path, atol=2e-6, rtol=0)


@needs_kernels
def test_small_blocks_and_bf16_operands():
    """bf16 operands keep fp32 accumulation: the same q as the torch path that upcasts them."""
    hidden_all, hidden_removed, weight, bias_ = inputs(3, 21, 48, 200, dtype=torch.bfloat16)
    q = triton_divergence.fused_replay_divergence(
        hidden_all, hidden_removed, weight, bias_, 1.0, block_n=16, block_v=32, block_h=16
    )
    torch_path = replay_divergence(hidden_all, hidden_removed, weight, bias_, backend="torch")
    torch.testing.assert_close(q, torch_path, atol=2e-6, rtol=0)


@needs_kernels
def test_triton_backend_refuses_cpu_tensors_outside_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA"):
        replay_divergence(torch.zeros(2, 4), torch.zeros(1, 2, 4), torch.zeros(8, 4), backend="triton")


def _pretend_triton(monkeypatch, kernel):
    monkeypatch.setattr(triton_divergence, "fused_replay_divergence", kernel)
    monkeypatch.setattr(triton_divergence, "is_available", lambda: True)


def test_an_explicit_kernel_is_checked_at_its_real_shape_and_a_partial_last_tile(monkeypatch):
    """`triton` is validated once at start-up on 4,096 synthetic tokens at the lm_head's shape and one row fewer; a
    kernel that computes the wrong thing (a GPU-specific bug) is refused there, naming the sizes."""
    from trl_mrtpo.ops import divergence

    seen = []

    def right(hidden_all, hidden_removed, weight, bias, temperature):
        seen.append((hidden_all.shape[0], weight.shape[0]))
        return divergence._torch_divergence(hidden_all, hidden_removed, weight, bias, temperature, None) + 1e-6

    def wrong(hidden_all, hidden_removed, weight, bias, temperature):
        q = divergence._torch_divergence(hidden_all, hidden_removed, weight, bias, temperature, None)
        return q * (1.5 if weight.shape[0] % 2 else 1.0)  # only the partial tile's shape is wrong

    weight = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    _pretend_triton(monkeypatch, right)
    triton_divergence.validate_triton_kernel(weight, None, 0.7)
    assert seen == [(4096, 50), (4096, 49)]
    _pretend_triton(monkeypatch, wrong)
    with pytest.raises(ValueError, match=r"disagrees with the torch path on 4096 synthetic tokens .*vocabulary 49"):
        triton_divergence.validate_triton_kernel(weight, None, 0.7)


def test_the_trainer_checks_an_explicit_kernel_at_start_up(monkeypatch, tiny_model, tiny_tokenizer, tmp_path):
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset
    from trl_mrtpo.ops import divergence

    _pretend_triton(monkeypatch, lambda a, r, w, b, t: divergence._torch_divergence(a, r, w, b, t, None) + 0.5)
    with pytest.raises(ValueError, match="divergence_backend='triton': the fused kernel disagrees"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path, divergence_backend="triton"),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )
