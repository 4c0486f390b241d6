"""Fused Triton replay divergence for GPUs (docs/method.md step 4).

Two kernels over vocabulary tiles, neither of which materialises ``[N, V]`` logits:

1. ``_log_normaliser_kernel``: the log-sum-exp of every context's logits (``P_all`` and each ``P_not_m``), once per
   context row, so ``P_all``'s normaliser is shared by every reward.
2. ``_js_kernel``: per block of completion tokens and per vocabulary tile, ``P_all``'s log-probabilities
   tile once, then every removed context's tile, accumulating the JS terms of :func:`trl_mrtpo.ops.js_divergence`
   in fp32.

Logits are accumulated in fp32 (``tl.dot`` with fp32 accumulation; fp32 operands use IEEE precision, not TF32)
because bf16 logits are too coarse when two distributions are nearly equal. Under ``TRITON_INTERPRET=1`` the
kernels run on CPU tensors for testing; the interpreter's ``tl.dot`` is wrong on bf16 operands, so they are upcast.
"""

from __future__ import annotations

import math
import os

import torch

from ..constants import LN2, MAX_LOG_RATIO
from .divergence import DivergenceBackend, _torch_divergence

try:
    import triton
    import triton.language as tl
except ImportError:  # the `kernels` extra is not installed: the torch path is used
    triton = None


# The start-up check of an explicit ``divergence_backend="triton"``: synthetic tokens of the real lm_head's shape
# compared with the torch path, and the tolerance on q (bits in [0, 1]). Interpreter runs agree to ~1e-6 in fp32; the
# bound leaves room for bf16 tensor-core dots.
VALIDATION_TOKENS = 4096
VALIDATION_ATOL = 1e-3
VALIDATION_RTOL = 2e-2


def is_available() -> bool:
    """Whether Triton is importable."""
    return triton is not None


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _jit(fn):
    """``triton.jit`` when Triton is installed; otherwise the plain function, which nothing calls (the torch path
    runs instead). Keeps the kernels at module level, as TRL's kernels do."""
    return triton.jit(fn) if triton is not None else fn


@_jit
def _row_offsets(rows, stride):
    """Element offsets of rows in 64 bits: ``rows * stride`` passes 2^31 with many replayed tokens (e.g. 7
    contexts x 90k tokens x H=3584), where int32 arithmetic would wrap."""
    return rows.to(tl.int64) * stride


@_jit
def _logits_tile(
    hidden_ptr,
    rows,
    row_mask,
    weight_ptr,
    bias_ptr,
    cols,
    col_mask,
    hidden_size,
    hidden_stride,
    weight_stride,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h_start in range(0, hidden_size, BLOCK_H):
        hs = h_start + tl.arange(0, BLOCK_H)
        h_mask = hs < hidden_size
        a = tl.load(
            hidden_ptr + _row_offsets(rows, hidden_stride)[:, None] + hs[None, :],
            mask=row_mask[:, None] & h_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            weight_ptr + _row_offsets(cols, weight_stride)[None, :] + hs[:, None],
            mask=col_mask[None, :] & h_mask[:, None],
            other=0.0,
        )
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    return acc * inv_temperature


@_jit
def _log_normaliser_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    out_ptr,
    num_rows,
    vocab_size,
    hidden_size,
    hidden_stride,
    weight_stride,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    running_max = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v_start in range(0, vocab_size, BLOCK_V):
        cols = v_start + tl.arange(0, BLOCK_V)
        col_mask = cols < vocab_size
        logits = _logits_tile(
            hidden_ptr, rows, row_mask, weight_ptr, bias_ptr, cols, col_mask, hidden_size, hidden_stride,
            weight_stride, inv_temperature, HAS_BIAS, FP32_DOT, BLOCK_N, BLOCK_V, BLOCK_H,
        )  # fmt: skip
        logits = tl.where(col_mask[None, :], logits, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(logits, 1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(logits - new_max[:, None]), 1)
        running_max = new_max
    tl.store(out_ptr + rows, running_max + tl.log(running_sum), mask=row_mask)


@_jit
def _js_kernel(
    hidden_ptr,
    weight_ptr,
    bias_ptr,
    log_normaliser_ptr,
    out_ptr,
    num_tokens,
    num_removed,
    vocab_size,
    hidden_size,
    hidden_stride,
    weight_stride,
    inv_temperature,
    HAS_BIAS: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    token_mask = tokens < num_tokens
    normaliser_all = tl.load(log_normaliser_ptr + tokens, mask=token_mask, other=0.0)
    for v_start in range(0, vocab_size, BLOCK_V):
        cols = v_start + tl.arange(0, BLOCK_V)
        col_mask = cols < vocab_size
        logprobs_all = _logits_tile(
            hidden_ptr, tokens, token_mask, weight_ptr, bias_ptr, cols, col_mask, hidden_size, hidden_stride,
            weight_stride, inv_temperature, HAS_BIAS, FP32_DOT, BLOCK_N, BLOCK_V, BLOCK_H,
        ) - normaliser_all[:, None]  # fmt: skip
        for m in range(num_removed):
            rows = (m + 1) * num_tokens + tokens  # < the row count; offsets go 64-bit in _row_offsets
            normaliser = tl.load(log_normaliser_ptr + rows, mask=token_mask, other=0.0)
            logprobs = _logits_tile(
                hidden_ptr, rows, token_mask, weight_ptr, bias_ptr, cols, col_mask, hidden_size, hidden_stride,
                weight_stride, inv_temperature, HAS_BIAS, FP32_DOT, BLOCK_N, BLOCK_V, BLOCK_H,
            ) - normaliser[:, None]  # fmt: skip
            gap = tl.minimum(tl.abs(logprobs - logprobs_all), MAX_LOG_RATIO)
            smaller_share = tl.exp(-gap)
            to_mixture = LN2 - tl.log(1.0 + smaller_share)
            terms = tl.exp(tl.maximum(logprobs, logprobs_all)) * (
                (1.0 + smaller_share) * to_mixture - smaller_share * gap
            )
            partial = tl.sum(tl.where(col_mask[None, :], terms, 0.0), 1)
            acc_ptr = out_ptr + m * num_tokens + tokens
            tl.store(acc_ptr, tl.load(acc_ptr, mask=token_mask, other=0.0) + partial, mask=token_mask)


def fused_replay_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    block_n: int = 32,
    block_v: int = 128,
    block_h: int = 64,
) -> torch.Tensor:
    """``[M, N]`` fp32 ``JS(p_all || p_not_m) / ln 2`` per token; see :func:`trl_mrtpo.ops.replay_divergence`.

    Operands keep the lm_head's dtype (bf16 on GPU: exact products, fp32 sums); hidden states are cast to it.
    Block sizes are not autotuned.
    """
    if triton is None:
        raise RuntimeError("The triton backend needs Triton: pip install 'trl-mrtpo[kernels]'.")
    if not (hidden_all.is_cuda or interpreting()):
        raise ValueError("The triton backend needs CUDA tensors (or TRITON_INTERPRET=1 for testing on CPU).")
    num_removed, num_tokens, hidden_size = hidden_removed.shape
    vocab_size = lm_head_weight.shape[0]
    # rows are addressed by stride: only the hidden dimension must be contiguous (no copy of a strided lm_head)
    weight = lm_head_weight if lm_head_weight.stride(-1) == 1 else lm_head_weight.contiguous()
    stacked = torch.cat([hidden_all[None], hidden_removed]).to(weight.dtype).reshape(-1, hidden_size)
    stacked = stacked if stacked.stride(-1) == 1 else stacked.contiguous()
    bias = lm_head_bias.contiguous() if lm_head_bias is not None else weight  # dummy pointer when HAS_BIAS is False
    meta = {
        "HAS_BIAS": lm_head_bias is not None,
        "FP32_DOT": interpreting() or weight.dtype == torch.float32,
        "BLOCK_N": block_n,
        "BLOCK_V": block_v,
        "BLOCK_H": block_h,
    }
    device = hidden_all.device
    log_normaliser = torch.empty(stacked.shape[0], dtype=torch.float32, device=device)
    out = torch.zeros(num_removed, num_tokens, dtype=torch.float32, device=device)
    inv_temperature = 1.0 / temperature
    _log_normaliser_kernel[(triton.cdiv(stacked.shape[0], block_n),)](
        stacked, weight, bias, log_normaliser, stacked.shape[0], vocab_size, hidden_size, stacked.stride(0),
        weight.stride(0), inv_temperature, **meta,
    )  # fmt: skip
    _js_kernel[(triton.cdiv(num_tokens, block_n),)](
        stacked, weight, bias, log_normaliser, out, num_tokens, num_removed, vocab_size, hidden_size,
        stacked.stride(0), weight.stride(0), inv_temperature, **meta,
    )  # fmt: skip
    return out.mul_(0.5 / LN2).clamp_(0.0, 1.0)


@torch.no_grad()
def validate_triton_kernel(
    lm_head_weight: torch.Tensor, lm_head_bias: torch.Tensor | None, temperature: float, seed: int = 0
) -> None:
    """The start-up check of an explicit ``divergence_backend="triton"``: the kernel against the torch path on
    :data:`VALIDATION_TOKENS` synthetic tokens with two removed contexts, at the real lm_head's shape and one row
    fewer (so the last vocabulary tile is partial whatever the tile size), in the weight's dtype and device. Raises
    ``ValueError`` naming the sizes when they disagree beyond the tolerance."""
    generator = torch.Generator(device=lm_head_weight.device).manual_seed(seed)
    hidden_size = lm_head_weight.shape[1]
    shape = (3, VALIDATION_TOKENS, hidden_size)
    hidden = torch.randn(shape, generator=generator, device=lm_head_weight.device).to(lm_head_weight.dtype)
    for rows in (lm_head_weight.shape[0], lm_head_weight.shape[0] - 1):
        weight = lm_head_weight[:rows]
        bias = None if lm_head_bias is None else lm_head_bias[:rows]
        fused = fused_replay_divergence(hidden[0], hidden[1:], weight, bias, temperature).float()
        reference = _torch_divergence(hidden[0], hidden[1:], weight, bias, temperature, None)
        error = (fused - reference).abs().max().item()
        bound = VALIDATION_ATOL + VALIDATION_RTOL * reference.abs().max().item()
        if not (fused.shape == reference.shape and math.isfinite(error) and error <= bound):
            raise ValueError(
                f"divergence_backend='triton': the fused kernel disagrees with the torch path on {VALIDATION_TOKENS} "
                f"synthetic tokens (max |diff| {error:.3g} > {bound:.3g}; 2 removed contexts, hidden {hidden_size}, "
                f"vocabulary {rows}, {lm_head_weight.dtype}). Use divergence_backend='torch' (or 'auto')."
            )


# Looked up at each call, so that the functions of this module are what runs (tests stand in for the kernel).
BACKEND = DivergenceBackend(
    compute=lambda *args: fused_replay_divergence(*args),
    check=lambda *args: validate_triton_kernel(*args),
    missing=lambda: None if is_available() else "needs Triton: pip install 'trl-mrtpo[kernels]'",
)
