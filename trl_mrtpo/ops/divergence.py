"""Jensen-Shannon divergence between next-token distributions, in fp32 and log space (docs/method.md step 4).

The torch path is here. The one other backend is the fused Triton kernel (:mod:`trl_mrtpo.ops.triton_divergence`,
its ``BACKEND``), which computes the same q and is imported only when a run names it."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..constants import (
    DEFAULT_CHUNK_ELEMENTS,
    LN2,
    MAX_LOG_RATIO,
    MIN_CHUNK_TOKENS,
    REPLAY_WORKSPACE_FRACTION,
    VOCAB_TILE,
)

# Tests run the device rule on CPU by setting this (everything but its one CUDA-only line: an fp32-output GEMM of
# low-precision operands, which the CPU has not; it casts those operands to fp32 once instead).
_DEVICE_RULE_ON_CPU = False


@dataclass(frozen=True)
class DivergenceBackend:
    """A way to compute :func:`replay_divergence` other than torch's: ``compute(hidden_all, hidden_removed, weight,
    bias, temperature)`` returns ``[M, N]`` fp32 q; ``check(weight, bias, temperature)`` runs once at start-up when a
    run names the backend; ``missing()`` says what to install when it cannot run here (None: it can)."""

    compute: Callable[..., torch.Tensor]
    check: Callable[..., None] | None = None
    missing: Callable[[], str | None] = lambda: None


# backends beside torch: the module whose ``BACKEND`` it is, imported when a run names it (not on the default path)
SHIPPED_BACKENDS = {"triton": "trl_mrtpo.ops.triton_divergence"}


def divergence_backends() -> tuple[str, ...]:
    """What ``divergence_backend`` may name."""
    return ("auto", "torch", *SHIPPED_BACKENDS)


def divergence_backend(name: str) -> DivergenceBackend | None:
    """The backend ``name`` (None for ``"auto"`` and ``"torch"``, this module's), its module imported on first use."""
    if name not in SHIPPED_BACKENDS:
        return None
    return importlib.import_module(SHIPPED_BACKENDS[name]).BACKEND


def js_divergence(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """Step 4: ``JS(p || q) / ln 2`` over the last (vocabulary) dimension, clamped to [0, 1].

    Each vocabulary entry is written around the larger of its two probabilities, ``b = max(p, q)``, with
    ``a = |log p - log q|`` and ``u = exp(-a)`` (so the smaller one is ``b u`` and ``m = b (1 + u) / 2``):

        ``JS = 1/2 sum b ((1 + u)(ln 2 - log1p(u)) - u a)``

    This is exactly 0 on identical inputs (``log1p(1)`` is ``ln 2``), agrees with float64 to ~1e-7 bits even where
    one distribution moves most of its mass onto tokens the other finds unlikely (no ``d + ln 2 - softplus(d)``
    cancellation), and needs two ``exp`` and one ``log1p`` per entry (the ``log1p(0.5 * expm1(.))`` form needs
    more passes for the same accuracy). ``a`` is clamped to 100 so zero-probability (-inf) entries contribute their
    exact limit instead of NaN.

    Args:
        logprobs_p, logprobs_q: log-probabilities (normalised), broadcastable, ``[..., V]``.

    Returns:
        ``[...]`` divergence in bits.
    """
    return ((0.5 / LN2) * _js_terms(logprobs_p, logprobs_q)).clamp_(0.0, 1.0)


def _js_terms(logprobs_p: torch.Tensor, logprobs_q: torch.Tensor) -> torch.Tensor:
    """``sum_v b ((1 + u)(ln 2 - log1p(u)) - u a)`` over the last dimension (twice JS in nats, before the clamp): a
    sum over vocabulary entries, so vocabulary tiles add up."""
    # In-place steps: at most three vocabulary-sized temporaries are alive at once (replay memory is bounded by them).
    gap = (logprobs_q - logprobs_p).nan_to_num_(0.0, MAX_LOG_RATIO, -MAX_LOG_RATIO).abs_().clamp_(max=MAX_LOG_RATIO)
    smaller_share = gap.neg().exp_()  # u = min(p, q) / max(p, q)
    terms = torch.log1p(smaller_share).neg_().add_(LN2)  # log b - log m
    terms.addcmul_(terms, smaller_share).sub_(smaller_share.mul_(gap))  # (1 + u)(log b - log m) - u a
    del gap, smaller_share
    larger = torch.maximum(logprobs_p, logprobs_q).exp_()
    return larger.mul_(terms).sum(-1)


def chosen_backend(backend: str) -> str:
    """The backend ``replay_divergence`` runs: an explicit name as given; ``"auto"`` is ``"torch"`` on every device
    until the Triton kernel has passed ``benchmarks/gpu_check.py`` on a GPU (it has run in Triton's CPU interpreter
    only): one decision for every process, never a per-rank fallback."""
    return "torch" if backend == "auto" else backend


def replay_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Per-token relevance ``q[m, t] = JS(p_all_t || p_not_m_t) / ln 2`` from last hidden states.

    Two backends compute the same thing without ever holding ``[N, V]`` logits for every context:

    - ``torch`` (CPU, or GPUs without Triton): the ``M + 1`` contexts of a token chunk go through the shared lm_head
      in one fp32 matmul; ``P_all``'s log-softmax is computed once per chunk and shared by every removed context.
      Memory is bounded by the chunk.
    - ``triton`` (CUDA), registered by :mod:`trl_mrtpo.ops.triton_divergence`: tiles the vocabulary, with fp32
      accumulation and one log-normaliser per context shared across rewards.

    ``auto`` is ``torch`` (:func:`chosen_backend`); a registered backend is an explicit choice, checked once at
    start-up (its ``check``).

    Args:
        hidden_all: ``[N, H]`` last hidden states at the N completion positions after ``P_all``.
        hidden_removed: ``[M, N, H]`` the same positions after each ``P_not_m``.
        lm_head_weight: ``[V, H]``; lm_head_bias: ``[V]`` or None.
        temperature: sampling temperature; logits are divided by it.
        chunk_size: tokens per chunk of the torch path; default keeps ``(M + 1) * chunk * V`` near 2M elements,
            with at least 8 tokens.
        backend: ``"auto"``, ``"torch"`` or a registered backend's name.

    Returns:
        ``[M, N]`` fp32 relevance in [0, 1].
    """
    if hidden_removed.dim() != 3 or hidden_removed.shape[1:] != hidden_all.shape:
        raise ValueError(
            f"hidden_removed must be [M, N, H] matching hidden_all {tuple(hidden_all.shape)}, "
            f"got {tuple(hidden_removed.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if backend not in divergence_backends():
        raise ValueError(f"backend must be one of {divergence_backends()}, got {backend!r}")
    if chosen_backend(backend) != "torch":
        registered = divergence_backend(backend)
        return registered.compute(hidden_all, hidden_removed, lm_head_weight, lm_head_bias, temperature)
    if hidden_all.is_cuda or _DEVICE_RULE_ON_CPU:
        workspace = device_workspace(hidden_all.device)
        return workspace_divergence(
            hidden_all, hidden_removed, lm_head_weight, lm_head_bias, temperature, workspace, chunk_size
        )
    return _torch_divergence(hidden_all, hidden_removed, lm_head_weight, lm_head_bias, temperature, chunk_size)


def device_workspace(device: torch.device) -> int:
    """Bytes the device rule may use for one chunk's logits and JS temporaries: a fixed share
    (:data:`~trl_mrtpo.constants.REPLAY_WORKSPACE_FRACTION`) of the device's total memory, so the chunking is the
    same every step; 2 GiB off CUDA (the device rule forced on CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory * REPLAY_WORKSPACE_FRACTION)
    return 2 << 30


def workspace_chunk(workspace: int, vocab: int, num_removed: int) -> int:
    """Tokens per chunk of :func:`workspace_divergence`: its peak is ``(3K + 1)`` fp32 vocabulary rows per token for
    ``K`` removed contexts (the ``K + 1`` log-probability rows, then two ``K``-row JS temporaries), at least 1."""
    return max(1, workspace // (4 * vocab * (3 * num_removed + 1)))


def workspace_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    workspace: int,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The device rule of the torch path (step 4; docs/kernels.md): ``[M, N]`` q in token chunks of
    :func:`workspace_chunk` tokens (``chunk_size`` when given), the whole vocabulary at once, one pass.

    The ``M + 1`` contexts are stacked once as ``[N, M + 1, H]`` in the hidden states' dtype; each chunk is one GEMM
    with the weight's dtype as operands and fp32 output (cuBLAS; the temperature and the bias in its epilogue), one
    ``log_softmax`` and the JS of :func:`_js_terms` in place: about 23 aten operators and one GEMM per chunk,
    ``ceil(N / chunk)`` chunks, whatever the vocabulary.
    """
    num_removed, num_tokens, hidden_size = hidden_removed.shape
    vocab = lm_head_weight.shape[0]
    chunk = chunk_size or workspace_chunk(workspace, vocab, num_removed)
    stacked = torch.cat([hidden_all[:, None], hidden_removed.transpose(0, 1)], dim=1)  # [N, M + 1, H]
    weight = lm_head_weight.t()
    low_precision = weight.dtype != torch.float32
    on_device = stacked.is_cuda or stacked.is_meta
    if stacked.dtype != weight.dtype or (low_precision and not on_device):
        stacked, weight = stacked.float(), weight.float()  # once per call: a CPU has no fp32-output bf16 GEMM
        low_precision = False
    bias = torch.zeros((), device=stacked.device) if lm_head_bias is None else lm_head_bias.float()
    beta = 0.0 if lm_head_bias is None else 1.0 / temperature
    sums = []
    for start in range(0, num_tokens, chunk):
        rows = stacked[start : start + chunk].view(-1, hidden_size)
        if low_precision:  # cuBLAS: bf16 / fp16 operands, fp32 accumulation and output
            logits = torch.addmm(bias, rows, weight, beta=beta, alpha=1.0 / temperature, out_dtype=torch.float32)
        else:
            logits = torch.addmm(bias, rows, weight, beta=beta, alpha=1.0 / temperature)
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


def _torch_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
) -> torch.Tensor:
    """The chunked torch path of :func:`replay_divergence`: fp32 lm_head and JS over token chunks (a weight in
    another dtype goes to :func:`_tiled_divergence`, which never holds an fp32 copy of the whole lm_head)."""
    if lm_head_weight.dtype != torch.float32:
        return _tiled_divergence(hidden_all, hidden_removed, lm_head_weight, lm_head_bias, temperature)
    num_removed, num_tokens = hidden_removed.shape[:2]
    vocab = lm_head_weight.shape[0]
    if chunk_size is None:
        chunk_size = max(MIN_CHUNK_TOKENS, DEFAULT_CHUNK_ELEMENTS // ((num_removed + 1) * vocab))
    bias = None if lm_head_bias is None else lm_head_bias.float()
    out = torch.empty(num_removed, num_tokens, dtype=torch.float32, device=hidden_all.device)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        stacked = torch.cat([hidden_all[None, start:end], hidden_removed[:, start:end]]).float()
        logits = torch.nn.functional.linear(stacked, lm_head_weight, bias)
        if temperature != 1.0:
            logits.div_(temperature)
        logprobs = torch.log_softmax(logits, dim=-1)
        del logits
        out[:, start:end] = js_divergence(logprobs[0], logprobs[1:])
    return out


def _tiled_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """The torch path for a low-precision lm_head (bf16, fp16): fp32 logits from vocabulary tiles of
    :data:`VOCAB_TILE` rows cast to fp32 one at a time, in two passes over the tiles (each context's log-normaliser,
    then the JS terms tile by tile, which add up over the vocabulary). The extra memory is one fp32 tile and
    ``[M + 1, tokens, tile]`` logits, never ``V x H`` in fp32; each tile is cast twice per call. Logits are never
    rounded to the weight's dtype."""
    num_removed, num_tokens = hidden_removed.shape[:2]
    vocab, device = lm_head_weight.shape[0], hidden_all.device
    tokens = max(MIN_CHUNK_TOKENS, DEFAULT_CHUNK_ELEMENTS // ((num_removed + 1) * VOCAB_TILE))

    def tiled_logits():
        """``(token rows, [M + 1, rows, tile] fp32 logits)``, one tile's weight cast at a time, one chunk alive."""
        for start in range(0, vocab, VOCAB_TILE):
            weight = lm_head_weight[start : start + VOCAB_TILE].float()
            bias = None if lm_head_bias is None else lm_head_bias[start : start + VOCAB_TILE].float()
            for first in range(0, num_tokens, tokens):
                rows = slice(first, min(first + tokens, num_tokens))
                stacked = torch.cat([hidden_all[None, rows], hidden_removed[:, rows]]).float()
                yield rows, torch.nn.functional.linear(stacked, weight, bias).div_(temperature)

    normaliser = torch.full((num_removed + 1, num_tokens), -math.inf, device=device)
    for rows, logits in tiled_logits():
        normaliser[:, rows] = torch.logaddexp(normaliser[:, rows], torch.logsumexp(logits, dim=-1))
    total = torch.zeros(num_removed, num_tokens, dtype=torch.float32, device=device)
    for rows, logits in tiled_logits():
        logprobs = logits.sub_(normaliser[:, rows, None])
        total[:, rows] += _js_terms(logprobs[0], logprobs[1:])
    return ((0.5 / LN2) * total).clamp_(0.0, 1.0)
