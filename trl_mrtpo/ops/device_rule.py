"""The device rule of the replay divergence's torch path (docs/method.md step 4; docs/kernels.md), CUDA's: chunks of a
fixed number of fp32 vocabulary rows sized from the memory free when the replay starts, each one fp32-output GEMM of
every context's rows and the JS in place; and the start-up check of that projection against float64. Its GEMM
generator is the Triton kernel's too. Loaded only where it runs (CUDA, the kernel, or forced on CPU by
``trl_mrtpo.ops.divergence._DEVICE_RULE_ON_CPU``)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from packaging.version import Version
from transformers.utils import logging

from ..constants import (
    LN2,
    MAX_LOG_RATIO,
    REPLAY_CHUNK_ROWS,
    REPLAY_CHUNK_SHARE,
    REPLAY_FORWARD_SHARE,
    REPLAY_STATES_SHARE,
)
from .js import softcapped_

logger = logging.get_logger(__name__)


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


@contextmanager
def ieee_fp32(device: torch.device):
    """fp32 GEMMs on ``device`` in IEEE fp32 inside, whatever the global TF32 setting (``TrainingArguments(tf32=True)``
    sets it; TF32 errs by about 3 % of a near-regime q), restored afterwards. Nothing off CUDA."""
    matmul = torch.backends.cuda.matmul
    name = "fp32_precision" if hasattr(matmul, "fp32_precision") else "allow_tf32"  # torch 2.9 renamed the flag
    saved = getattr(matmul, name) if device.type == "cuda" else None
    if saved is not None:
        setattr(matmul, name, "ieee" if name == "fp32_precision" else False)
    try:
        yield
    finally:
        if saved is not None:
            setattr(matmul, name, saved)


def fp32_logits(
    rows: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor, scale: float, fp32_weight_t: torch.Tensor | None
) -> torch.Tensor:
    """``scale * (rows @ weight_t + bias)`` in fp32, never rounded to the operands' dtype (step 4's logits); ``bias``
    fp32, or 0-d when the head has none.

    Where :func:`fp32_output_gemm_applies`, one cuBLAS GEMM of the operands as they are (fp32 accumulation and output)
    as ``torch.mm(..., out_dtype=torch.float32)``, the form TRL and Liger call (torch 2.11's ``addmm`` refuses
    ``out_dtype`` beside ``beta`` and ``alpha``), then the bias and the scale in place; elsewhere an IEEE fp32 GEMM
    (:func:`ieee_fp32`) of the rows upcast and ``fp32_weight_t`` (the weight upcast once per call by the caller), with
    the bias and the scale in its epilogue."""
    if fp32_output_gemm_applies(rows, weight_t):
        logits = torch.mm(rows, weight_t, out_dtype=torch.float32)
        if bias.dim():
            logits.add_(bias)
        return logits.mul_(scale) if scale != 1.0 else logits
    with ieee_fp32(rows.device):
        return torch.addmm(bias, rows.float(), fp32_weight_t, beta=scale if bias.dim() else 0.0, alpha=scale)


def usable_memory(device: torch.device) -> int:
    """Bytes the replay may take on ``device`` now: what the device has free plus what torch's allocator holds
    reserved and unused; 8 GiB off CUDA (the device rule forced on CPU, Triton's interpreter)."""
    if device.type != "cuda":
        return 8 << 30
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def run_usable_memory(device: torch.device, vocab: int) -> int:
    """:func:`usable_memory` when a run first replays, logged with the chunk and the streams it gives them."""
    usable = usable_memory(device)
    logger.info(
        f"MRTPO's replay is sized from {usable / 2**30:.1f} GiB usable on {device}: divergence chunks of "
        f"{budget_chunk_rows(usable, vocab)} fp32 vocabulary rows, streams of at most "
        f"{budget_states_bytes(usable) / 2**30:.2f} GiB of hidden states, for the whole run."
    )
    return usable


def budget_chunk_rows(usable: int, vocab: int) -> int:
    """fp32 vocabulary rows per divergence chunk: :data:`~trl_mrtpo.constants.REPLAY_CHUNK_ROWS`, fewer where they
    would take more than :data:`~trl_mrtpo.constants.REPLAY_CHUNK_SHARE` of ``usable`` bytes; at least 1."""
    return max(1, min(REPLAY_CHUNK_ROWS, int(REPLAY_CHUNK_SHARE * usable) // (4 * vocab)))


def budget_states_bytes(usable: int) -> int:
    """Bytes of replayed hidden states held at once (one stream of responses): a share of ``usable``
    (:data:`~trl_mrtpo.constants.REPLAY_STATES_SHARE`)."""
    return int(REPLAY_STATES_SHARE * usable)


def budget_forward_tokens(usable: int, config, element_size: int) -> int:
    """New tokens per replay forward: a share of ``usable`` (:data:`~trl_mrtpo.constants.REPLAY_FORWARD_SHARE`) over
    what one token holds at a forward's widest, from the decoder's ``config``: the MLP's gate, up and their product,
    four hidden-sized activations, and its key/value cache in every layer; at least 1."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    kv_width = kv_heads * (getattr(config, "head_dim", None) or hidden // heads)
    mlp = getattr(config, "intermediate_size", None) or 4 * hidden
    per_token = (3 * mlp + 4 * hidden + 2 * config.num_hidden_layers * kv_width) * element_size
    return max(1, int(REPLAY_FORWARD_SHARE * usable) // per_token)


def chunk_tokens(chunk_rows: int, rows_per_token: int) -> int:
    """Tokens per chunk when each token holds ``rows_per_token`` fp32 vocabulary rows at the chunk's peak, at least
    1: ``3K + 1`` for the torch device rule with K removed contexts (the ``K + 1`` log-probability rows, then two
    ``K``-row JS temporaries), ``K + 1`` for the Triton kernel (the logits alone)."""
    return max(1, chunk_rows // rows_per_token)


def chunk_logits(
    stacked: torch.Tensor, lm_head_weight: torch.Tensor, lm_head_bias: torch.Tensor | None, scale: float, chunk: int
) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first token, [n (M + 1), V] fp32 logits)`` per chunk of ``chunk`` tokens of ``stacked`` (``[N, M + 1, H]``:
    each token's ``P_all`` state, then its removed contexts'), read as views: the GEMM of the device rule and of the
    Triton kernel. Hidden states are never rounded down to a lower-precision head; the weight is upcast once per call
    where needed; no chunk stays alive between yields."""
    hidden_size = lm_head_weight.shape[1]
    if stacked.stride(-1) != 1:
        raise ValueError(f"the replay's hidden states need a unit last stride, got strides {stacked.stride()}")
    weight_t = lm_head_weight.t()
    fp32_weight_t = None if fp32_output_gemm_applies(stacked, weight_t) else weight_t.float()  # a copy if not fp32
    bias = torch.zeros((), device=stacked.device) if lm_head_bias is None else lm_head_bias.float()
    for start in range(0, stacked.shape[0], chunk):
        rows = stacked[start : start + chunk].reshape(-1, hidden_size)  # a view of a contiguous buffer
        yield start, fp32_logits(rows, weight_t, bias, scale, fp32_weight_t)


# The start-up checks' synthetic states (check_projection; the kernel's check_kernel): logits with a spread of about
# LOGIT_SPREAD, and near contexts whose states are P_all's plus noise of NEAR_NOISE of its scale, where removing a
# block changes little (median q 1e-4 to 1e-3 bits): where MRTPO's q lives.
NEAR_NOISE = 0.01
LOGIT_SPREAD = 3.0
# The projection's check: tokens and removed contexts at the real head, float64 vocabulary tiles, and its bound,
# relative to the median float64 q. Measured on CPU at H 3,584, V 32,768: IEEE fp32 logits err by 6e-5 of it, TF32
# operands (10-bit mantissas) by 3e-2, logits rounded to bf16 by more than 1.
PROJECTION_TOKENS = 16
PROJECTION_REMOVED = 3
PROJECTION_RTOL = 1e-3
FLOAT64_TILE = 8192


def check_states(
    lm_head_weight: torch.Tensor, tokens: int, removed: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 ``P_all`` states ``[tokens, H]`` and removed contexts' ``[removed, tokens, H]`` far (independent) and
    near (``P_all``'s plus :data:`NEAR_NOISE` noise), scaled to logits of spread :data:`LOGIT_SPREAD`."""
    device, hidden_size = lm_head_weight.device, lm_head_weight.shape[1]
    scale = float(lm_head_weight[:4096].float().norm(dim=1).mean()) or 1.0  # a sample of rows: no fp32 head copy
    base = torch.randn(tokens, hidden_size, generator=generator, device=device) * (LOGIT_SPREAD / scale)
    far = torch.randn(removed, tokens, hidden_size, generator=generator, device=device) * (LOGIT_SPREAD / scale)
    noise = torch.randn(removed, tokens, hidden_size, generator=generator, device=device)
    near = base + noise * (NEAR_NOISE * base.norm(dim=-1, keepdim=True) / hidden_size**0.5)
    return base, far, near


def float64_js(logits: torch.Tensor, temperature: float, softcap: float | None) -> torch.Tensor:
    """``[M, N]`` textbook float64 JS / ln 2 between ``logits[:, 0]`` and each ``logits[:, m]`` (``[N, M + 1, V]``,
    transformed as the model's forward and sampling do)."""
    z = logits.double()
    z = (softcap * torch.tanh(z / softcap) if softcap else z) / temperature
    p = torch.softmax(z, -1)
    mixture = 0.5 * (p[:, :1] + p[:, 1:])

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a.log() - mixture.log()), 0.0).sum(-1)

    return (0.5 * (kl(p[:, :1]) + kl(p[:, 1:])) / math.log(2)).t()


@torch.no_grad()
def check_projection(
    lm_head_weight: torch.Tensor, lm_head_bias: torch.Tensor | None, temperature: float, softcap: float | None = None
) -> dict:
    """The start-up check of the replay's projection on the real lm_head: the GEMM both backends take their logits
    from (:func:`chunk_logits`), on :data:`PROJECTION_TOKENS` near-context tokens, against logits projected in float64
    through the same head in vocabulary tiles (never a float64 copy of it), both read by :func:`float64_js`. The q
    of the GEMM's logits must be within :data:`PROJECTION_RTOL` of the float64 q's median: TF32, an autocast caller or
    a GEMM that rounds its output to bf16 is refused, IEEE fp32 passes. Raises ``ValueError`` naming the error and the
    bound; returns the figures."""
    generator = torch.Generator(device=lm_head_weight.device).manual_seed(0)
    base, _, near = check_states(lm_head_weight, PROJECTION_TOKENS, PROJECTION_REMOVED, generator)
    stacked = torch.cat([base[:, None], near.transpose(0, 1)], dim=1).to(lm_head_weight.dtype)
    ((_, logits),) = chunk_logits(stacked, lm_head_weight, lm_head_bias, 1.0, PROJECTION_TOKENS)
    rows = stacked.reshape(-1, stacked.shape[-1]).double()
    exact = torch.cat(
        [
            rows @ lm_head_weight[v : v + FLOAT64_TILE].double().T
            + (0.0 if lm_head_bias is None else lm_head_bias[v : v + FLOAT64_TILE].double())
            for v in range(0, lm_head_weight.shape[0], FLOAT64_TILE)
        ],
        dim=1,
    )
    shape = (PROJECTION_TOKENS, PROJECTION_REMOVED + 1, -1)
    reference = float64_js(exact.view(shape), temperature, softcap)
    error = (float64_js(logits.view(shape), temperature, softcap) - reference).abs().max().item()
    median = reference.median().item()
    bound = PROJECTION_RTOL * median
    if not (math.isfinite(error) and error <= bound):
        raise ValueError(
            f"The replay's lm_head projection is not fp32-exact on this device: on near contexts its q is off the "
            f"float64 projection's by {error:.3g} bits, over the bound {bound:.3g} ({PROJECTION_RTOL:g} of the median "
            f"q, {median:.3g} bits; {PROJECTION_TOKENS} tokens, {PROJECTION_REMOVED} removed contexts, head "
            f"{tuple(lm_head_weight.shape)} {lm_head_weight.dtype}). TF32 matmuls, an autocast around the trainer or "
            "a GEMM that rounds its output to bf16 do this; train without them."
        )
    return {"max_error": error, "median_q": median, "bound": bound}


def device_divergence(
    stacked: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    chunk_rows: int | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The device rule of the torch path (step 4; docs/kernels.md): ``[M, N]`` q of ``stacked`` (``[N, M + 1, H]``)
    in token chunks of ``chunk_rows`` fp32 vocabulary rows, ``3M + 1`` per token (default: :func:`budget_chunk_rows`
    of the memory usable now), or of ``chunk_size`` tokens when given; the whole vocabulary at once, one pass.

    Each chunk is one GEMM of :func:`chunk_logits` (the temperature in its epilogue unless a softcap comes first),
    one ``log_softmax`` and the JS of :func:`_js_terms_in_place` in place: about 24 aten operators
    and one GEMM per chunk, whatever the vocabulary.
    """
    num_tokens, contexts = stacked.shape[:2]
    num_removed, vocab = contexts - 1, lm_head_weight.shape[0]
    if num_tokens == 0:
        return torch.zeros(num_removed, 0, dtype=torch.float32, device=stacked.device)
    rows = chunk_rows or budget_chunk_rows(usable_memory(stacked.device), vocab)
    chunk = chunk_size or chunk_tokens(rows, 3 * num_removed + 1)
    scale = 1.0 if softcap is not None else 1.0 / temperature
    sums = []
    for _, logits in chunk_logits(stacked, lm_head_weight, lm_head_bias, scale, chunk):
        if softcap is not None:
            softcapped_(logits, softcap, temperature)
        logprobs = torch.log_softmax(logits.view(-1, contexts, vocab), dim=-1)
        del logits
        sums.append(_js_terms_in_place(logprobs[:, :1], logprobs[:, 1:]))
        del logprobs  # before the next chunk's logits: one chunk is alive at a time
    return torch.cat(sums).mul_(0.5 / LN2).clamp_(0.0, 1.0).t()


def _js_terms_in_place(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """:func:`~trl_mrtpo.ops.js.js_terms` over the last dimension, overwriting ``logprobs_q`` (``[n, M, V]``, with
    ``logprobs_p`` ``[n, 1, V]``): ``[n, M]``. Two ``[n, M, V]`` temporaries; ``-u a`` is written ``u log u``
    (``u = exp(-a)``), so ``a`` need not be kept beside ``u``."""
    larger = torch.maximum(logprobs_p, logprobs_q)
    gap = logprobs_q.sub_(logprobs_p).abs_().nan_to_num_(MAX_LOG_RATIO).clamp_(max=MAX_LOG_RATIO)  # as js_terms
    share = gap.neg_().exp_()  # u = min(p, q) / max(p, q), in the gap's buffer
    terms = torch.log1p(share).neg_().add_(LN2)  # log b - log m
    terms.addcmul_(terms, share).add_(share.xlogy_(share))  # (1 + u)(log b - log m) - u a
    return larger.exp_().mul_(terms).sum(-1)
