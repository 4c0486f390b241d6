"""The Triton row kernel (cuBLAS logits per chunk, one program per token) against float64 and liger-kernel's JSD, on
CPU under TRITON_INTERPRET=1 (or on a GPU), and its start-up check.

Triton reads TRITON_INTERPRET when a kernel is defined, i.e. when `trl_mrtpo.ops.triton_divergence` is first
imported; other test modules import it first, so on a machine without CUDA this module re-runs itself in a subprocess
with the interpreter on (about 25 s of CI per run of the fast tier).

Tolerances (bits): far contexts (q about 0.9) within 2e-6 of float64; near contexts (median q 1e-4 to 1e-3) within
6e-3 of each token's own q (relative). Measured: the kernel errs by up to 5e-3 at V = 50 and 3e-4 to 5e-4 at V = 32,000
to 49,153 (the torch rule 3e-3 and 1e-4 to 4e-4: the same fp32 formula); logits rounded to bf16 err by about 10 %.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from tests.reference import js_float64
from trl_mrtpo.ops import device_rule, divergence, replay_divergence, triton_divergence
from trl_mrtpo.ops.divergence import stacked_states
from trl_mrtpo.ops.js import js_divergence

pytestmark = pytest.mark.skipif(not triton_divergence.is_available(), reason="Triton is not installed")
RUNS_KERNELS = triton_divergence.interpreting() or torch.cuda.is_available()
DEVICE = "cuda" if torch.cuda.is_available() and not triton_divergence.interpreting() else "cpu"
needs_kernels = pytest.mark.skipif(not RUNS_KERNELS, reason="runs in the interpreter subprocess")


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


def inputs(removed, tokens, hidden, vocab, dtype=torch.float32, bias=True, near=False, seed=0):
    """Hidden states and a head whose logits have a spread of about 3; ``near``: each removed context is P_all's state
    plus 1 % noise (median q 1e-4 to 1e-3 bits), else independent (q about 0.9 bits)."""
    gen = torch.Generator().manual_seed(seed)
    hidden_all = torch.randn(tokens, hidden, generator=gen)
    noise = torch.randn(removed, tokens, hidden, generator=gen)
    hidden_removed = hidden_all + 0.01 * noise if near else noise
    weight = torch.randn(vocab, hidden, generator=gen) * (3 / hidden**0.5)
    bias_ = torch.randn(vocab, generator=gen) if bias else None
    move = {"device": DEVICE, "dtype": dtype}
    return (
        hidden_all.to(**move),
        hidden_removed.to(**move),
        weight.to(**move),
        None if bias_ is None else bias_.to(**move),
    )


def reference_q(hidden_all, hidden_removed, weight, bias, temperature, softcap):
    """``[K, N]`` q in float64 from the textbook JS, the logits transformed as the model's forward and sampling do."""

    def logits(hidden):
        z = hidden.double().cpu() @ weight.double().cpu().T + (0 if bias is None else bias.double().cpu())
        return (softcap * torch.tanh(z / softcap) if softcap else z) / temperature

    return torch.stack([js_float64(logits(hidden_all), logits(h)) for h in hidden_removed])


def assert_q_close(q, expected, near):
    q = q.double().cpu()
    if near:
        assert expected.median() < 2e-3, expected.median()  # the regime is as described
        torch.testing.assert_close(q, expected, rtol=6e-3, atol=1e-9)
    else:
        torch.testing.assert_close(q, expected, atol=2e-6, rtol=0)


@needs_kernels
@pytest.mark.parametrize(
    ("removed", "tokens", "hidden", "vocab", "dtype", "bias", "softcap", "temperature", "chunk"),
    [
        (1, 5, 16, 50, torch.float32, False, None, 1.0, None),
        (3, 7, 40, 49_153, torch.float32, True, None, 0.7, 3),  # V not a multiple of the block; a partial last chunk
        (3, 6, 32, 3_001, torch.bfloat16, True, 30.0, 1.0, 4),  # Gemma 2's cap
        (8, 5, 24, 1_000, torch.float16, True, 5.0, 1.3, None),  # a cap that binds
    ],
)
@pytest.mark.parametrize("near", [False, True], ids=["far", "near"])
def test_the_kernel_matches_float64(removed, tokens, hidden, vocab, dtype, bias, softcap, temperature, chunk, near):
    """K in {1, 3, 8}; fp32, bf16 and fp16 heads; a bias; a softcap; temperature other than 1; near and far."""
    hidden_all, hidden_removed, weight, bias_ = inputs(removed, tokens, hidden, vocab, dtype, bias, near)
    head = (weight, bias_, temperature, softcap, chunk)
    q = triton_divergence.fused_replay_divergence(stacked_states(hidden_all, hidden_removed), *head)
    assert q.shape == (removed, tokens) and q.dtype == torch.float32
    assert_q_close(q, reference_q(hidden_all, hidden_removed, weight, bias_, temperature, softcap), near)


@needs_kernels
def test_the_backend_is_the_kernel_and_identical_contexts_give_zero():
    hidden_all, hidden_removed, weight, bias = inputs(3, 9, 16, 300)
    hidden_removed[1] = hidden_all
    q = replay_divergence(hidden_all, hidden_removed, weight, bias, 0.7, backend="triton")
    assert q[1].abs().max().item() < 1e-6
    torch.testing.assert_close(q, replay_divergence(hidden_all, hidden_removed, weight, bias, 0.7), atol=2e-6, rtol=0)


@needs_kernels
def test_minus_inf_logits_give_the_torch_rules_q():
    """A bias of -inf on a whole first vocabulary block and on scattered entries (tokens a model can never emit):
    p = q = 0 there, whose JS terms are 0 on both backends, not NaN (the kernel's online log-sum-exp met a block of
    -inf as exp(-inf - -inf))."""
    hidden_all, hidden_removed, weight, bias = inputs(3, 6, 16, 5_000)
    bias[: triton_divergence.MAX_BLOCK_V] = -math.inf
    bias[::7] = -math.inf
    stacked = stacked_states(hidden_all, hidden_removed)
    kernel = triton_divergence.fused_replay_divergence(stacked, weight, bias, 0.7)
    rule = device_rule.device_divergence(stacked, weight, bias, 0.7)
    assert torch.isfinite(kernel).all() and torch.isfinite(rule).all()
    torch.testing.assert_close(kernel, rule, atol=2e-6, rtol=0)


@needs_kernels
def test_every_number_of_removed_contexts_is_compiled_at_start_up(monkeypatch):
    """One variant per power of two of ``K + 1``: up to 8 removed contexts, K' = 1, 3, 7 and 8 are run once."""
    seen = []
    original = triton_divergence.fused_replay_divergence

    def recording(stacked, *args, **kwargs):
        seen.append(stacked.shape[1] - 1)
        return original(stacked, *args, **kwargs)

    monkeypatch.setattr(triton_divergence, "fused_replay_divergence", recording)
    _, _, weight, bias = inputs(1, 1, 16, 300)
    triton_divergence.warm_kernel(weight, bias, 1.0, None, 8)
    assert seen == [1, 3, 7, 8]
    seen.clear()
    triton_divergence.warm_kernel(weight, bias, 1.0, None, 2)
    assert seen == [1, 2]


@needs_kernels
def test_empty_input_gives_k_by_zero():
    empty = stacked_states(torch.zeros(0, 8, device=DEVICE), torch.zeros(3, 0, 8, device=DEVICE))
    q = triton_divergence.fused_replay_divergence(empty, torch.zeros(50, 8, device=DEVICE))
    assert q.shape == (3, 0)


@needs_kernels
@pytest.mark.parametrize("near", [False, True], ids=["far", "near"])
def test_q_equals_liger_kernels_jsd_at_beta_one_half(near):
    """liger-kernel's JSD primitive at beta = 0.5 is JS in nats per vocabulary entry (its loss tile): summed over the
    vocabulary and divided by ln 2, our q per token. Liger's form (``P (log P - log M)`` terms) loses about 1e-7 bits
    to cancellation on near contexts, hence the absolute bound there."""
    backends = pytest.importorskip("liger_kernel.ops.backends._triton.jsd")
    hidden_all, hidden_removed, weight, bias = inputs(3, 8, 32, 2_000, near=near)
    q = triton_divergence.fused_replay_divergence(stacked_states(hidden_all, hidden_removed), weight, bias)
    all_logprobs = torch.log_softmax(hidden_all @ weight.T + bias, -1)
    for m in range(3):
        removed_logprobs = torch.log_softmax(hidden_removed[m] @ weight.T + bias, -1)
        tile, _ = backends.jsd_loss_and_grad_triton(removed_logprobs.clone(), all_logprobs, None, 0.5, -100, 1.0)
        liger = tile.sum(-1).double() / math.log(2)
        if near:
            torch.testing.assert_close(q[m].double(), liger, rtol=6e-3, atol=1.5e-7)
        else:
            torch.testing.assert_close(q[m].double(), liger, atol=5e-6, rtol=0)


@needs_kernels
def test_the_kernel_reads_the_chunks_logits_exactly_twice(monkeypatch):
    """The bytes the row kernel loads, counted in the interpreter, are ``KERNEL_LOGIT_READS`` x the chunk's fp32
    logits: the modelled bytes of :func:`modelled_bytes` are the kernel's, and an extra pass fails here."""
    if not triton_divergence.interpreting():
        pytest.skip("counts the interpreter's loads")
    from triton.runtime.interpreter import InterpreterBuilder

    loaded = []
    original = InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, *args):
        handle = original(self, ptrs, mask, other, *args)
        loaded.append(int(mask.data.sum()) * handle.data.dtype.itemsize)
        return handle

    monkeypatch.setattr(InterpreterBuilder, "create_masked_load", counting)
    tokens, removed, vocab = 5, 3, 5_000
    hidden_all, hidden_removed, weight, _ = inputs(removed, tokens, 16, vocab)
    triton_divergence.fused_replay_divergence(stacked_states(hidden_all, hidden_removed), weight, None, 1.0, None, 2)
    assert sum(loaded) == triton_divergence.KERNEL_LOGIT_READS * tokens * (removed + 1) * vocab * 4


def test_the_modelled_bytes_are_within_1_3x_of_the_floor():
    """At the 7B head (V 152,064, H 3,584), 64 x 1,024 tokens, K = 3 and chunks of 2,048 rows (512 tokens): the
    GEMM's operands (the weight once per chunk), the logits written once and read twice, against the floor."""
    tokens, removed, vocab, hidden = 64 * 1024, 3, 152_064, 3_584
    chunk = device_rule.chunk_tokens(2048, removed + 1)
    figures = triton_divergence.modelled_bytes(tokens, removed, vocab, hidden, chunk)
    assert figures["total"] <= 1.3 * figures["floor"], figures
    assert 0.45e12 < figures["floor"] < 0.55e12


def _rounds_logits_to_bf16(stacked, weight, bias, temperature, softcap=None, chunk_size=None):
    """A planted kernel bug: the right maths on logits rounded to bf16 (what a bf16 GEMM output would give)."""
    z = stacked.transpose(0, 1).float() @ weight.float().T
    z = (z + (0 if bias is None else bias.float())).bfloat16().float()
    z = (softcap * torch.tanh(z / softcap) if softcap else z) / temperature
    logprobs = torch.log_softmax(z, -1)
    return js_divergence(logprobs[0], logprobs[1:])


def _torch_rule(stacked, weight, bias, temperature, softcap=None):
    return divergence._torch_divergence(stacked, weight, bias, temperature, None, softcap)


def test_the_start_up_check_refuses_a_kernel_that_rounds_logits_to_bf16():
    """It passes the torch rule itself and refuses the planted kernel on near contexts, naming the regime and the
    error (at V 8,192 and H 256 the check took 1.0 s on one CPU core here: docs/kernels.md)."""
    torch.set_num_threads(1)
    weight = torch.randn(8_192, 256, generator=torch.Generator().manual_seed(1)) / 16
    figures = triton_divergence.check_kernel(weight, None, 1.0, kernel=_torch_rule)
    assert 1e-4 <= figures["near_8192"]["median_q"] <= 1e-3, figures  # the near regime is where MRTPO's q lives
    assert figures["far_8192"]["median_q"] > 0.5
    with pytest.raises(ValueError, match=r"disagrees with the torch rule on near contexts \(max \|diff\|"):
        triton_divergence.check_kernel(weight, None, 1.0, kernel=_rounds_logits_to_bf16)


def _pretend_triton(monkeypatch, kernel):
    monkeypatch.setattr(triton_divergence, "fused_replay_divergence", kernel)
    monkeypatch.setattr(triton_divergence, "is_available", lambda: True)


def test_the_trainer_checks_an_explicit_kernel_at_start_up(monkeypatch, tiny_model, tiny_tokenizer, tmp_path):
    from tests.helpers import make_args
    from trl_mrtpo import MRTPOTrainer
    from trl_mrtpo.kits.basic import KIT as BASIC
    from trl_mrtpo.kits.basic import make_basic_dataset

    _pretend_triton(monkeypatch, lambda *args, softcap=None: _torch_rule(*args, softcap) + 0.5)
    with pytest.raises(ValueError, match="divergence_backend='triton': the kernel disagrees"):
        MRTPOTrainer(
            model=tiny_model,
            reward_funcs=BASIC.rewards,
            info_blocks=BASIC.info_blocks,
            args=make_args(tmp_path, divergence_backend="triton"),
            train_dataset=make_basic_dataset(4),
            processing_class=tiny_tokenizer,
        )


def test_auto_takes_the_kernel_only_after_its_check_and_a_faster_timing(monkeypatch, caplog):
    """The device path forced on CPU with the check and the timings stubbed: the kernel only when the check passes
    and it is faster; a failing check or a slower kernel keeps torch, and off CUDA nothing runs."""
    calls = []
    weight = torch.zeros(50, 8)

    def stub(check_fails=False, kernel_s=1.0):
        def check(*args):
            calls.append("check")
            if check_fails:
                raise ValueError("the kernel disagrees")
            return {}

        monkeypatch.setattr(triton_divergence, "check_kernel", check)
        monkeypatch.setattr(
            triton_divergence,
            "time_against_torch",
            lambda *args: calls.append("time") or {"triton_s": kernel_s, "torch_s": 2.0},
        )

    monkeypatch.setattr(triton_divergence, "is_available", lambda: True)
    stub()
    assert triton_divergence.auto_backend(weight, None, 1.0, None) == "torch" and calls == []  # off CUDA
    monkeypatch.setattr(triton_divergence, "on_cuda", lambda tensor: True)
    with caplog.at_level("INFO", logger="trl_mrtpo.ops.triton_divergence"):
        assert triton_divergence.auto_backend(weight, None, 1.0, None) == "triton" and calls == ["check", "time"]
    assert "chose 'triton'" in caplog.text and "'triton_s': 1.0" in caplog.text
    calls.clear()
    stub(kernel_s=3.0)
    assert triton_divergence.auto_backend(weight, None, 1.0, None) == "torch" and calls == ["check", "time"]
    calls.clear()
    stub(check_fails=True)
    assert triton_divergence.auto_backend(weight, None, 1.0, None) == "torch" and calls == ["check"]
