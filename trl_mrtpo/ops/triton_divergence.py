"""The replay divergence on CUDA in Liger's shape: cuBLAS logits per token chunk, then one Triton row kernel
(docs/method.md step 4; docs/kernels.md).

Per chunk of tokens, the ``K + 1`` contexts' logits ``z = h W^T + b`` come from one GEMM with fp32 output
(:func:`~trl_mrtpo.ops.device_rule.fp32_logits`, the torch device rule's GEMM). Then one program per token reads its
``K + 1`` rows twice, looping over them inside the program (no power-of-two padding of K):

1. each row's log-normaliser ``log sum_v exp(f(z_v))``, online (a running max and sum of exp), with
   ``f(z) = softcap * tanh(z / softcap) / T`` as the model's forward and sampling transform the logits;
2. per vocabulary block, ``P_all``'s block once, then each removed context's block, accumulating

   ``JS = 1/2 sum_v b ((1 + u)(ln 2 - log(1 + u)) - u a)``, ``a = |log p - log q|``, ``u = e^-a``, ``b = max(p, q)``

   (:func:`trl_mrtpo.ops.js_divergence` derives it; exact JS needs both normalisers, hence the two reads).

The kernel writes ``[K, tokens]`` and keeps nothing ``[N, V]`` beyond one chunk's logits. Its memory traffic is the
GEMM's operands, the chunk's logits written once and read twice, and ``K`` floats per token
(:func:`modelled_bytes`). Under ``TRITON_INTERPRET=1`` it runs on CPU tensors for testing.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import torch

from ..constants import LN2, MAX_LOG_RATIO
from .device_rule import (
    budget_chunk_rows,
    check_states,
    chunk_logits,
    chunk_tokens,
    device_divergence,
    usable_memory,
)
from .divergence import DivergenceBackend, stacked_states

try:
    import triton
    import triton.language as tl

    # a compiled kernel reads module constants only as constexpr (the interpreter does not check this)
    _LN2 = tl.constexpr(LN2)
    _MAX_LOG_RATIO = tl.constexpr(MAX_LOG_RATIO)
except ImportError:  # the `kernels` extra is not installed: the torch path is used
    triton = None

logger = logging.getLogger(__name__)

# Liger's JSD kernel's choices: vocabulary blocks of at most 4,096 columns, 4 warps, no autotuning.
MAX_BLOCK_V = 4096
NUM_WARPS = 4

# The start-up check (:func:`check_kernel`): tokens per regime at the real lm_head's shape, 3 removed contexts, far
# and near (:func:`~trl_mrtpo.ops.device_rule.check_states`; q about 0.9 bits and 1e-4 to 1e-3 bits).
CHECK_TOKENS = 256
CHECK_REMOVED = 3
# Bounds on |kernel - torch rule| in bits: far, absolute; near, relative to the near regime's median q (a kernel that
# rounds the logits to bf16 errs by about 10 % of it there; fp32 logits agree to well under 1 %).
FAR_ATOL = 1e-5
NEAR_RTOL = 0.01


def is_available() -> bool:
    """Whether Triton is importable."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _jit(fn):
    """``triton.jit`` when Triton is installed; otherwise the plain function, which nothing calls."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def _transformed(z, softcap, inv_temperature, HAS_SOFTCAP: tl.constexpr):
    """``softcap * tanh(z / softcap) / T`` (tanh as ``2 sigmoid(2x) - 1``, as TRL's kernels write it)."""
    if HAS_SOFTCAP:
        z = softcap * (2.0 * tl.sigmoid(2.0 * z / softcap) - 1.0)
    return z * inv_temperature


@_jit
def _js_rows_kernel(
    logits_ptr,
    row_stride,
    out_ptr,
    num_tokens,
    num_removed,
    vocab_size,
    softcap,
    inv_temperature,
    HAS_SOFTCAP: tl.constexpr,
    CONTEXTS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # One program per token; its K + 1 rows (P_all, then P_not_1..K) are consecutive rows of the chunk's logits.
    token = tl.program_id(0).to(tl.int64)
    first_row = logits_ptr + token * (num_removed + 1) * row_stride
    contexts = tl.arange(0, CONTEXTS)
    log_normalisers = tl.zeros((CONTEXTS,), dtype=tl.float32)
    # Read 1: each row's online log-sum-exp.
    for r in range(num_removed + 1):
        row = first_row + r * row_stride
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, vocab_size, BLOCK_V):
            offsets = start + tl.arange(0, BLOCK_V)
            mask = offsets < vocab_size
            z = _transformed(tl.load(row + offsets, mask=mask, other=0.0), softcap, inv_temperature, HAS_SOFTCAP)
            z = tl.where(mask, z, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(z, axis=0))
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)  # all -inf so far: exp(-inf - -inf) is NaN
            running_sum = running_sum * tl.exp(running_max - shift) + tl.sum(tl.exp(z - shift), axis=0)
            running_max = new_max
        log_normalisers = tl.where(contexts == r, running_max + tl.log(running_sum), log_normalisers)
    # Read 2: per vocabulary block, P_all's block once, then each removed context's block.
    log_normaliser_all = tl.sum(tl.where(contexts == 0, log_normalisers, 0.0), axis=0)
    sums = tl.zeros((CONTEXTS,), dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        offsets = start + tl.arange(0, BLOCK_V)
        mask = offsets < vocab_size
        z_all = tl.load(first_row + offsets, mask=mask, other=0.0)
        logprobs_all = _transformed(z_all, softcap, inv_temperature, HAS_SOFTCAP) - log_normaliser_all
        for m in range(1, num_removed + 1):
            z = tl.load(first_row + m * row_stride + offsets, mask=mask, other=0.0)
            log_normaliser = tl.sum(tl.where(contexts == m, log_normalisers, 0.0), axis=0)
            logprobs = _transformed(z, softcap, inv_temperature, HAS_SOFTCAP) - log_normaliser
            gap = tl.minimum(tl.abs(logprobs - logprobs_all), _MAX_LOG_RATIO)
            share = tl.exp(-gap)  # u = min(p, q) / max(p, q)
            terms = tl.exp(tl.maximum(logprobs, logprobs_all)) * (
                (1.0 + share) * (_LN2 - tl.log(1.0 + share)) - share * gap
            )
            # an entry where both are -inf (p = q = 0) adds its limit, 0, as the torch rule's does
            counted = mask & (tl.maximum(logprobs, logprobs_all) > float("-inf"))
            sums = tl.where(contexts == m, sums + tl.sum(tl.where(counted, terms, 0.0), axis=0), sums)
    # out is [K, num_tokens]: removed context m's sum goes to row m - 1
    written = (contexts >= 1) & (contexts <= num_removed)
    tl.store(out_ptr + (contexts - 1).to(tl.int64) * num_tokens + token, sums, mask=written)


def block_v(vocab: int) -> int:
    """Vocabulary columns per block: the next power of two, at most :data:`MAX_BLOCK_V` (Liger's rule)."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(vocab))


def fused_replay_divergence(
    stacked: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """``[M, N]`` fp32 ``JS(p_all || p_not_m) / ln 2`` per token of ``stacked`` (``[N, M + 1, H]``,
    :func:`~trl_mrtpo.ops.divergence.stacked_states`); see :func:`trl_mrtpo.ops.replay_divergence`.

    Token chunks of ``chunk_rows`` fp32 vocabulary rows, ``M + 1`` per token (default:
    :func:`~trl_mrtpo.ops.device_rule.budget_chunk_rows` of the memory usable now), or of ``chunk_size`` tokens; per
    chunk one fp32-output GEMM, then :func:`_js_rows_kernel`, launched on the states' device.
    """
    if triton is None:
        raise RuntimeError("The triton backend needs Triton: pip install 'trl-mrtpo[kernels]'.")
    if not (stacked.is_cuda or interpreting()):
        raise ValueError("The triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for testing on CPU).")
    num_tokens, contexts = stacked.shape[:2]
    num_removed, vocab = contexts - 1, lm_head_weight.shape[0]
    out = torch.empty(num_removed, num_tokens, dtype=torch.float32, device=stacked.device)
    if num_tokens == 0:
        return out
    rows = chunk_rows or budget_chunk_rows(usable_memory(stacked.device), vocab)
    chunk = chunk_size or chunk_tokens(rows, contexts)
    meta = {
        "HAS_SOFTCAP": softcap is not None,
        "CONTEXTS": triton.next_power_of_2(contexts),
        "BLOCK_V": block_v(vocab),
        "num_warps": NUM_WARPS,
    }
    # z + b from the GEMM; f(z) in the kernel, on the states' GPU (not the current one: device_map="auto")
    with torch.cuda.device(stacked.device) if stacked.is_cuda else contextlib.nullcontext():
        for start, logits in chunk_logits(stacked, lm_head_weight, lm_head_bias, 1.0, chunk):
            if logits.stride(1) != 1:
                raise ValueError(f"the kernel reads logits rows with a unit stride, got strides {logits.stride()}")
            tokens = logits.shape[0] // contexts
            _js_rows_kernel[(tokens,)](
                logits, logits.stride(0), out[:, start:], num_tokens, num_removed, vocab,
                float(softcap or 1.0), 1.0 / temperature, **meta,
            )  # fmt: skip
            del logits  # before the next chunk's: one chunk is alive at a time
    return out.mul_(0.5 / LN2).clamp_(0.0, 1.0)


def warm_kernel(
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    max_removed: int,
) -> None:
    """Compiles the kernel for every number of removed contexts from 1 to ``max_removed`` (one variant per power of
    two of ``M + 1``) on one token, at start-up rather than mid-training when a batch first replays that many."""
    hidden = torch.zeros(1, max_removed + 1, lm_head_weight.shape[1], dtype=lm_head_weight.dtype,
                         device=lm_head_weight.device)  # fmt: skip
    for removed in sorted({min(max_removed, 2**p - 1) for p in range(1, max_removed.bit_length() + 1)}):
        fused_replay_divergence(hidden[:, : removed + 1], lm_head_weight, lm_head_bias, temperature, softcap)


def modelled_bytes(tokens: int, removed: int, vocab: int, hidden: int, chunk: int, operand_bytes: int = 2) -> dict:
    """The memory traffic of :func:`fused_replay_divergence`, by its structure: per chunk the GEMM reads its hidden
    rows and the whole weight and writes ``(K + 1)`` fp32 logit rows per token; the row kernel reads those rows
    twice and writes ``K`` floats per token. Beside it, the floor: the GEMM's operands read once and the logits
    written once and read twice."""
    rows = tokens * (removed + 1)
    logits = rows * vocab * 4
    chunks = math.ceil(tokens / chunk)
    operands = rows * hidden * operand_bytes + vocab * hidden * operand_bytes
    gemm = rows * hidden * operand_bytes + chunks * vocab * hidden * operand_bytes + logits
    kernel = KERNEL_LOGIT_READS * logits + removed * tokens * 4
    return {"gemm": gemm, "kernel": kernel, "total": gemm + kernel, "floor": operands + 3 * logits}


# The row kernel's reads of the chunk's logits (read 1: the normalisers; read 2: the JS sums); tests/ hold it against
# the bytes the kernel loads in Triton's interpreter.
KERNEL_LOGIT_READS = 2


@torch.no_grad()
def check_kernel(
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None = None,
    kernel=None,
    seed: int = 0,
) -> dict:
    """The start-up check of the kernel on the real lm_head: :data:`CHECK_TOKENS` synthetic tokens with
    :data:`CHECK_REMOVED` removed contexts in each of two regimes, against the torch device rule on the same device and
    dtype, at the lm_head's shape and at one row fewer (a partial last vocabulary block).

    - far contexts (independent hidden states): ``|diff| <= FAR_ATOL`` bits;
    - near contexts (``P_all``'s state plus 1 % noise; median q 1e-4 to 1e-3 bits): ``|diff| <= NEAR_RTOL x`` the
      near regime's median q, where a kernel that rounds logits to bf16 fails.

    Raises ``ValueError`` naming the regime, the error and the bound; returns the figures it measured. Its cost is
    that of 4 x 2 divergences of ``CHECK_TOKENS x 4`` rows over the vocabulary: at Qwen2.5-7B's head about 2 x 1 GB
    of weight reads and 4 x 0.6 GB of logits, milliseconds on a current GPU (docs/kernels.md).
    """
    kernel = kernel or fused_replay_divergence
    device, dtype = lm_head_weight.device, lm_head_weight.dtype
    generator = torch.Generator(device=device).manual_seed(seed)
    hidden_size = lm_head_weight.shape[1]
    base, far, near = check_states(lm_head_weight, CHECK_TOKENS, CHECK_REMOVED, generator)
    figures = {}
    for rows in (lm_head_weight.shape[0], lm_head_weight.shape[0] - 1):
        weight = lm_head_weight[:rows]
        bias = None if lm_head_bias is None else lm_head_bias[:rows]
        for regime, removed in (("near", near), ("far", far)):
            inputs = (stacked_states(base, removed).to(dtype), weight, bias, temperature)
            ours = kernel(*inputs, softcap=softcap)
            reference = device_divergence(*inputs, softcap=softcap)
            error = (ours.float() - reference).abs().max().item()
            median = reference.median().item()
            bound = FAR_ATOL if regime == "far" else NEAR_RTOL * median
            figures[f"{regime}_{rows}"] = {"max_error": error, "median_q": median, "bound": bound}
            if not (ours.shape == reference.shape and math.isfinite(error) and error <= bound):
                raise ValueError(
                    f"divergence_backend='triton': the kernel disagrees with the torch rule on {regime} contexts "
                    f"(max |diff| {error:.3g} bits > {bound:.3g}; median q {median:.3g} bits; {CHECK_TOKENS} tokens, "
                    f"{CHECK_REMOVED} removed contexts, hidden {hidden_size}, vocabulary {rows}, {dtype}). "
                    "Use divergence_backend='torch'."
                )
    return figures


def _seconds(function, repeats: int = 3) -> float:
    """Median wall seconds of ``repeats`` calls after one warm-up, synchronising CUDA around each."""
    function()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def time_against_torch(
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    tokens: int | None = None,
) -> dict:
    """Seconds of the kernel and of the torch rule on the same tokens of the real shape (3 removed contexts; by
    default two of the kernel's chunks, at most 4,096 tokens), the median of 3 runs each after a warm-up."""
    device, dtype = lm_head_weight.device, lm_head_weight.dtype
    vocab, hidden_size = lm_head_weight.shape
    tokens = tokens or min(2 * chunk_tokens(budget_chunk_rows(usable_memory(device), vocab), CHECK_REMOVED + 1), 4096)
    generator = torch.Generator(device=device).manual_seed(1)
    hidden = torch.randn(tokens, CHECK_REMOVED + 1, hidden_size, generator=generator, device=device).to(dtype)
    inputs = (hidden, lm_head_weight, lm_head_bias, temperature)
    return {
        "tokens": tokens,
        "triton_s": _seconds(lambda: fused_replay_divergence(*inputs, softcap)),
        "torch_s": _seconds(lambda: device_divergence(*inputs, softcap=softcap)),
    }


def on_cuda(tensor: torch.Tensor) -> bool:
    """Whether ``auto`` may consider the kernel for this lm_head (tests force the device path on CPU here)."""
    return tensor.is_cuda


def auto_backend(weight: torch.Tensor, bias: torch.Tensor | None, temperature: float, softcap: float | None) -> str:
    """``divergence_backend="auto"``: ``"triton"`` on CUDA when the kernel passes its precision check and is faster
    than the torch rule on this lm_head, on every process; else ``"torch"``. Logs the figures and the choice once."""
    if not (on_cuda(weight) and is_available()):
        return "torch"
    try:
        figures = {"check": check_kernel(weight, bias, temperature, softcap)}
        figures.update(time_against_torch(weight, bias, temperature, softcap))
        takes_kernel = figures["triton_s"] < figures["torch_s"]
    except Exception as error:  # noqa: BLE001 - a failing kernel is reported and the torch rule runs
        figures, takes_kernel = {"error": f"{type(error).__name__}: {error}"}, False
    agreed = torch.tensor(float(takes_kernel), device=weight.device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
    choice = "triton" if agreed.item() == 1.0 else "torch"
    logger.info("divergence_backend='auto' chose %r on this device: %s", choice, figures)
    return choice


# Looked up at each call, so that the functions of this module are what runs (tests stand in for the kernel).
BACKEND = DivergenceBackend(
    compute=lambda *args: fused_replay_divergence(*args),
    check=lambda *args: check_kernel(*args),
    warm=lambda *args: warm_kernel(*args),
    missing=lambda: None if is_available() else "needs Triton: pip install 'trl-mrtpo[kernels]'",
)
