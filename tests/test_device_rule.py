"""The replay divergence's device rule (CUDA; without one, forced on CPU by ``_DEVICE_RULE_ON_CPU``, everything but
its one CUDA-only line, the fp32-output GEMM of low-precision operands; on a GPU, on CUDA tensors): q against the
float64 reference for fp32, bf16 and fp16 heads, the same q whatever the chunk, and the aten operators of a
64 x 1,024-token batch counted on ``meta`` tensors at real shapes (docs/kernels.md)."""

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.reference import js_float64
from trl_mrtpo.ops import device_rule as rule_module
from trl_mrtpo.ops import divergence
from trl_mrtpo.ops.device_rule import budget_chunk_rows, chunk_tokens, device_divergence
from trl_mrtpo.ops.divergence import stacked_states

# On a GPU (benchmarks/gpu_check.py runs this file there) the rule runs on CUDA tensors, where it is the default.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device_rule(monkeypatch):
    monkeypatch.setattr(divergence, "_DEVICE_RULE_ON_CPU", True)


def inputs(dtype, seed=0, tokens=37, removed=3, hidden=16, vocab=101):
    gen = torch.Generator().manual_seed(seed)
    hidden_all = torch.randn(tokens, hidden, generator=gen)
    hidden_removed = hidden_all[None] + 0.5 * torch.randn(removed, tokens, hidden, generator=gen)
    hidden_removed[1] = hidden_all  # an identical context must give exactly 0
    weight = torch.randn(vocab, hidden, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen) * 0.1
    move = {"device": DEVICE, "dtype": dtype}
    return hidden_all.to(**move), hidden_removed.to(**move), weight.to(**move), bias.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_device_rule_matches_float64_for_every_head_dtype(device_rule, dtype):
    hidden_all, hidden_removed, weight, bias = inputs(dtype)
    q = divergence.replay_divergence(hidden_all, hidden_removed, weight, bias, temperature=0.7)
    assert q.shape == (3, 37) and q.dtype == torch.float32
    logits = (hidden_all.double() @ weight.double().T + bias.double()) / 0.7
    for m in range(3):
        removed = (hidden_removed[m].double() @ weight.double().T + bias.double()) / 0.7
        torch.testing.assert_close(q[m].double(), js_float64(logits, removed), atol=1e-6, rtol=0)
    assert q[1].abs().max().item() == 0.0


def test_q_is_the_same_whatever_the_chunk_the_last_one_partial(device_rule):
    hidden_all, hidden_removed, weight, bias = inputs(torch.bfloat16)
    stacked = stacked_states(hidden_all, hidden_removed)
    results = [device_divergence(stacked, weight, bias, 0.7, chunk_size=c) for c in (4, 10, 37)]
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], atol=1e-6, rtol=0)
    # without a chunk size, the chunk's rows decide: 2,048 rows hold the whole batch (3K + 1 = 10 rows a token), 100
    # rows 10 tokens
    assert chunk_tokens(2048, 10) >= 37 and chunk_tokens(100, 10) == 10
    small = device_divergence(stacked, weight, bias, 0.7, chunk_rows=100)
    torch.testing.assert_close(small, results[0], atol=1e-6, rtol=0)


def test_the_chunk_holds_2048_rows_within_a_quarter_of_the_usable_memory():
    """2,048 fp32 vocabulary rows at V = 152,064 take 1.25 GB: a card with 6 GiB usable keeps them (a quarter is
    1.61 GB); with 2 GiB usable a quarter holds 882 rows."""
    assert budget_chunk_rows(6 << 30, 152_064) == 2048
    assert budget_chunk_rows(2 << 30, 152_064) == (2 << 30) // 4 // (4 * 152_064) == 882
    assert budget_chunk_rows(1000, 152_064) == 1


class CountingOperators(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    "shape, vocab, hidden, dtype",
    [
        ("7B", 152_064, 3_584, torch.bfloat16),
        ("3B", 151_936, 2_048, torch.bfloat16),
        ("7B fp32", 152_064, 3_584, torch.float32),
    ],
)
def test_a_64_x_1024_token_batch_takes_one_gemm_per_chunk_and_24_operators_each(shape, vocab, hidden, dtype):
    """Chunks of 2,048 fp32 vocabulary rows at K = 3: ``chunk = floor(2048 / (3K + 1))`` tokens (204), ``ceil(N /
    chunk)`` GEMMs (322) and 24 operators per chunk plus 6 (7,734; 23 for an fp32 head, whose ``addmm`` takes the
    temperature in its epilogue); the chunked path before took 38,912 GEMMs and about 973,000 operators at the 7B
    shape, and 8-token chunks for an fp32 head."""
    tokens, removed = 64 * 1_024, 3
    stacked = torch.empty(tokens, removed + 1, hidden, device="meta", dtype=dtype)
    weight = torch.empty(vocab, hidden, device="meta", dtype=dtype)
    with CountingOperators() as counted:
        q = device_divergence(stacked, weight, None, 0.7, chunk_rows=2048)
    chunk = 2048 // (3 * removed + 1)
    chunks = math.ceil(tokens / chunk)
    assert q.shape == (removed, tokens) and chunk == 204
    assert counted.counts["mm" if dtype == torch.bfloat16 else "addmm"] == chunks
    # a bf16 head: torch.mm with fp32 output, then the temperature in place (one operator more than addmm's epilogue)
    per_chunk = 24 if dtype == torch.bfloat16 else 23
    assert sum(counted.counts.values()) == per_chunk * chunks + 6, dict(counted.counts)


def test_the_device_rule_returns_k_by_zero_on_empty_input(device_rule):
    empty = {"device": DEVICE}
    q = divergence.replay_divergence(
        torch.zeros(0, 16, **empty), torch.zeros(3, 0, 16, **empty), torch.zeros(101, 16, **empty)
    )
    assert q.shape == (3, 0) and q.dtype == torch.float32


def test_the_out_dtype_gemm_exists_from_torch_2_8():
    assert not rule_module.out_dtype_gemm_exists("2.7.1+cu126") and not rule_module.out_dtype_gemm_exists("2.6.0")
    assert rule_module.out_dtype_gemm_exists("2.8.0") and rule_module.out_dtype_gemm_exists("2.11.0+cu130")
    assert rule_module.out_dtype_gemm_exists("2.9.0.dev20250701")


class RecordingGemms(TorchDispatchMode):
    """Each GEMM's operator and overload: ``mm.dtype`` is the fp32-output GEMM of low-precision operands."""

    def __init__(self):
        super().__init__()
        self.gemms = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in ("mm", "addmm"):
            self.gemms.append(f"{func.overloadpacket.__name__}.{func._overloadname}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("torch_version", ["2.7.1+cu126", "2.13.0"])
def test_torch_before_2_8_never_reaches_out_dtype(monkeypatch, torch_version):
    """On a device that would take it (``meta`` stands for CUDA with capability >= 8), bf16 operands go to the
    fp32-output GEMM only where torch has it; before 2.8 the fallback (an fp32 GEMM of upcast operands) runs."""
    monkeypatch.setattr(rule_module, "_OUT_DTYPE_GEMM", rule_module.out_dtype_gemm_exists(torch_version))
    stacked = torch.empty(64, 4, 32, device="meta", dtype=torch.bfloat16)
    weight = torch.empty(1000, 32, device="meta", dtype=torch.bfloat16)
    with RecordingGemms() as recorded:
        device_divergence(stacked, weight, None, 0.7, chunk_size=16)
    expected = "mm.dtype" if torch_version.startswith("2.13") else "addmm.default"  # the fallback: fp32 operands
    assert recorded.gemms == [expected] * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_rule_applies_a_softcap_before_the_temperature(device_rule, dtype):
    hidden_all, hidden_removed, weight, bias = inputs(dtype)
    weight = weight * 8  # logits of several units: a cap of 3 binds
    q = divergence.replay_divergence(hidden_all, hidden_removed, weight, bias, temperature=0.7, softcap=3.0)

    def logits(hidden):
        z = hidden.double() @ weight.double().T + bias.double()
        return 3.0 * torch.tanh(z / 3.0) / 0.7

    for m in range(3):
        torch.testing.assert_close(
            q[m].double(), js_float64(logits(hidden_all), logits(hidden_removed[m])), atol=1e-6, rtol=0
        )
