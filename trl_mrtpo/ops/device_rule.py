"""The device rule of the replay divergence's torch path (docs/method.md step 4; docs/kernels.md), CUDA's: token
chunks sized from a fixed workspace, each one fp32-output GEMM of every context's rows and the JS in place. Its GEMM
generator is the Triton kernel's too. Loaded only where it runs (CUDA, the kernel, or forced on CPU by
``trl_mrtpo.ops.divergence._DEVICE_RULE_ON_CPU``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from packaging.version import Version

from ..constants import LN2, MAX_LOG_RATIO, REPLAY_WORKSPACE_FRACTION
from .divergence import softcapped_


def out_dtype_gemm_exists(version: str) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` exists in this torch release (2.8 and later)."""
    return Version(Version(version).base_version) >= Version("2.8")


_OUT_DTYPE_GEMM = out_dtype_gemm_exists(torch.__version__)


def fp32_output_gemm_applies(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp32_logits` can ask cuBLAS for fp32 output from low-precision operands: torch has the argument
    (2.8+), the operands are on CUDA with compute capability 8.0 or more (bf16 tensor cores) and are both bf16 or
    both fp16. ``meta`` tensors count as such a device (the operator counts of docs/kernels.md)."""
    if not (_OUT_DTYPE_GEMM and rows.dtype == weight.dtype and rows.dtype in (torch.bfloat16, torch.float16)):
        return False
    if rows.device.type == "meta":
        return True
    return rows.is_cuda and torch.cuda.get_device_capability(rows.device) >= (8, 0)


def fp32_logits(
    rows: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, scale: float, fp32_weight_t: torch.Tensor | None
) -> torch.Tensor:
    """``scale * (rows @ weight_t + bias)`` in fp32, never rounded to the operands' dtype (step 4's logits); ``bias``
    fp32, or 0-d when the head has none.

    Where :func:`fp32_output_gemm_applies`, one cuBLAS GEMM of the operands as they are (fp32 accumulation and output)
    as ``torch.mm(..., out_dtype=torch.float32)``, the form TRL and Liger call (torch 2.11's ``addmm`` refuses
    ``out_dtype`` beside ``beta`` and ``alpha``), then the bias and the scale in place; elsewhere an fp32 GEMM of the
    rows upcast and ``fp32_weight_t`` (the weight upcast once per call by the caller), with the bias and the scale in
    its epilogue."""
    if fp32_output_gemm_applies(rows, weight_t):
        logits = torch.mm(rows, weight_t, out_dtype=torch.float32)
        if bias.dim():
            logits.add_(bias)
        return logits.mul_(scale) if scale != 1.0 else logits
    return torch.addmm(bias, rows.float(), fp32_weight_t, beta=scale if bias.dim() else 0.0, alpha=scale)


def device_workspace(device: torch.device) -> int:
    """Bytes the device rule may use for one chunk's logits and JS temporaries: a fixed share
    (:data:`~trl_mrtpo.constants.REPLAY_WORKSPACE_FRACTION`) of the device's total memory, so the chunking is the
    same every step; 2 GiB off CUDA (the device rule forced on CPU, Triton's interpreter)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * REPLAY_WORKSPACE_FRACTION)
    return 2 << 30


def workspace_chunk(workspace: int, vocab: int, rows_per_token: int) -> int:
    """Tokens per chunk when each token holds ``rows_per_token`` fp32 vocabulary rows at the chunk's peak, at least
    1: ``3K + 1`` for the torch device rule with K removed contexts (the ``K + 1`` log-probability rows, then two
    ``K``-row JS temporaries), ``K + 1`` for the Triton kernel (the logits alone)."""
    return max(1, workspace // (4 * vocab * rows_per_token))


def chunk_logits(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    scale: float,
    chunk: int,
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first token, [n (M + 1), V] fp32 logits)`` per chunk, each token's ``P_all`` row then its removed contexts':
    the GEMM of the device rule and of the Triton kernel. Hidden states are never rounded down to a lower-precision
    head; the weight is upcast once per call where needed; no chunk stays alive between yields."""
    hidden_size = lm_head_weight.shape[1]
    dtype = lm_head_weight.dtype if hidden_all.dtype == lm_head_weight.dtype else torch.float32
    stacked = torch.cat([hidden_all[:, None], hidden_removed.transpose(0, 1)], dim=1).to(dtype)
    weight_t = lm_head_weight.t()
    fp32_weight_t = None if fp32_output_gemm_applies(stacked, weight_t) else weight_t.float()  # a copy if not fp32
    bias = torch.zeros((), device=stacked.device) if lm_head_bias is None else lm_head_bias.float()
    for start in range(0, stacked.shape[0], chunk):
        yield start, fp32_logits(stacked[start : start + chunk].reshape(-1, hidden_size), weight_t, bias, scale,
                                 fp32_weight_t)  # fmt: skip


def workspace_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    workspace: int,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The device rule of the torch path (step 4; docs/kernels.md): ``[M, N]`` q in token chunks of
    :func:`workspace_chunk` tokens (``chunk_size`` when given), the whole vocabulary at once, one pass.

    Each chunk is one GEMM of :func:`chunk_logits` (the temperature in its epilogue unless a softcap comes first),
    one ``log_softmax`` and the JS of :func:`_js_terms` in place: about 24 aten operators and one GEMM per chunk,
    ``ceil(N / chunk)`` chunks, whatever the vocabulary.
    """
    num_removed, num_tokens = hidden_removed.shape[:2]
    vocab = lm_head_weight.shape[0]
    if num_tokens == 0:
        return torch.zeros(num_removed, 0, dtype=torch.float32, device=hidden_all.device)
    chunk = chunk_size or workspace_chunk(workspace, vocab, 3 * num_removed + 1)
    scale = 1.0 if softcap is not None else 1.0 / temperature
    sums = []
    for _, logits in chunk_logits(hidden_all, hidden_removed, lm_head_weight, lm_head_bias, scale, chunk):
        if softcap is not None:
            softcapped_(logits, softcap, temperature)
        logprobs = torch.log_softmax(logits.view(-1, num_removed + 1, vocab), dim=-1)
        del logits
        sums.append(_js_terms_in_place(logprobs[:, :1], logprobs[:, 1:]))
        del logprobs  # before the next chunk's logits: the workspace holds one chunk
    return torch.cat(sums).mul_(0.5 / LN2).clamp_(0.0, 1.0).t()


def _js_terms_in_place(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """:func:`_js_terms` over the last dimension, overwriting ``logprobs_q`` (``[n, M, V]``, with ``logprobs_p``
    ``[n, 1, V]``): ``[n, M]``. Two ``[n, M, V]`` temporaries; ``-u a`` is written ``u log u`` (``u = exp(-a)``), so
    ``a`` need not be kept beside ``u``."""
    larger = torch.maximum(logprobs_p, logprobs_q)
    gap = logprobs_q.sub_(logprobs_p).abs_().nan_to_num_(MAX_LOG_RATIO).clamp_(max=MAX_LOG_RATIO)  # as _js_terms
    share = gap.neg_().exp_()  # u = min(p, q) / max(p, q), in the gap's buffer
    terms = torch.log1p(share).neg_().add_(LN2)  # log b - log m
    terms.addcmul_(terms, share).add_(share.xlogy_(share))  # (1 + u)(log b - log m) - u a
    return larger.exp_().mul_(terms).sum(-1)
