"""Jensen-Shannon divergence between next-token distributions, in fp32 and log space (docs/method.md step 4).

The torch path is here. The one other backend is the fused Triton kernel (:mod:`trl_mrtpo.ops.triton_divergence`,
its ``BACKEND``), which computes the same q and is imported only when a run names it."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from packaging.version import Version

from ..constants import (
    DEFAULT_CHUNK_ELEMENTS,
    LN2,
    MAX_LOG_RATIO,
    MIN_CHUNK_TOKENS,
    REPLAY_WORKSPACE_FRACTION,
    VOCAB_TILE,
)

# Tests run the device rule on CPU by setting this (everything but the fp32-output GEMM of low-precision operands,
# which only CUDA has: fp32_logits takes its tested fallback, an fp32 GEMM of upcast operands, instead).
_DEVICE_RULE_ON_CPU = False


@dataclass(frozen=True)
class DivergenceBackend:
    """A way to compute :func:`replay_divergence` other than torch's: ``compute(hidden_all, hidden_removed, weight,
    bias, temperature, softcap, chunk_size)`` returns ``[M, N]`` fp32 q; ``check(weight, bias, temperature, softcap)``
    runs once at start-up on the real lm_head and raises when the backend disagrees with the torch rule;
    ``missing()`` says what to install when it cannot run here (None: it can)."""

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
    """The backend ``replay_divergence`` runs for a name that reached it: ``"auto"`` is ``"torch"`` here (the trainer
    resolves ``auto`` once at start-up, :func:`trl_mrtpo.replay.replay_settings`, and passes what it chose)."""
    return "torch" if backend == "auto" else backend


def replay_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-token relevance ``q[m, t] = JS(p_all_t || p_not_m_t) / ln 2`` from last hidden states.

    Two backends compute the same thing without ever holding ``[N, V]`` logits for every context:

    - ``torch``: the ``M + 1`` contexts of a token chunk go through the shared lm_head in one GEMM with fp32 output;
      ``P_all``'s log-softmax is computed once per chunk and shared by every removed context. On CUDA the chunk is
      sized from a fixed workspace (:func:`workspace_divergence`); on CPU by :data:`DEFAULT_CHUNK_ELEMENTS`.
    - ``triton`` (CUDA, :mod:`trl_mrtpo.ops.triton_divergence`): the same GEMM per chunk, then one Triton program
      per token computes its ``M + 1`` log-normalisers and ``M`` JS sums in two reads of the chunk's logits.

    Logits are ``softcap * tanh(z / softcap)`` (when ``softcap`` is set, as Gemma 2's forward applies it) divided by
    ``temperature``, with ``z = h W^T + b`` in fp32.

    Args:
        hidden_all: ``[N, H]`` last hidden states at the N completion positions after ``P_all``.
        hidden_removed: ``[M, N, H]`` the same positions after each ``P_not_m``.
        lm_head_weight: ``[V, H]``; lm_head_bias: ``[V]`` or None.
        temperature: sampling temperature; logits are divided by it.
        chunk_size: tokens per chunk; default: the device's rule.
        backend: ``"auto"`` (torch), ``"torch"`` or ``"triton"``.
        softcap: the model's ``final_logit_softcapping``, or None.

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
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if backend not in divergence_backends():
        raise ValueError(f"backend must be one of {divergence_backends()}, got {backend!r}")
    head = (lm_head_weight, lm_head_bias, temperature)
    if chosen_backend(backend) != "torch":
        return divergence_backend(backend).compute(hidden_all, hidden_removed, *head, softcap, chunk_size)
    if hidden_all.is_cuda or _DEVICE_RULE_ON_CPU:
        workspace = device_workspace(hidden_all.device)
        return workspace_divergence(hidden_all, hidden_removed, *head, workspace, chunk_size, softcap)
    return _torch_divergence(hidden_all, hidden_removed, *head, chunk_size, softcap)


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


def softcapped_(logits: torch.Tensor, softcap: float | None, temperature: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap) / temperature`` in place (the logits as the model's forward, then sampling,
    transform them); only the division when ``softcap`` is None."""
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits.div_(temperature) if temperature != 1.0 else logits


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


def _torch_divergence(
    hidden_all: torch.Tensor,
    hidden_removed: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The chunked torch path of :func:`replay_divergence` off CUDA: fp32 lm_head and JS over token chunks (a weight
    in another dtype goes to :func:`_tiled_divergence`, which never holds an fp32 copy of the whole lm_head)."""
    if lm_head_weight.dtype != torch.float32:
        return _tiled_divergence(hidden_all, hidden_removed, lm_head_weight, lm_head_bias, temperature, softcap)
    num_removed, num_tokens = hidden_removed.shape[:2]
    vocab = lm_head_weight.shape[0]
    if chunk_size is None:
        chunk_size = max(MIN_CHUNK_TOKENS, DEFAULT_CHUNK_ELEMENTS // ((num_removed + 1) * vocab))
    bias = None if lm_head_bias is None else lm_head_bias.float()
    out = torch.empty(num_removed, num_tokens, dtype=torch.float32, device=hidden_all.device)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        stacked = torch.cat([hidden_all[None, start:end], hidden_removed[:, start:end]]).float()
        logits = softcapped_(torch.nn.functional.linear(stacked, lm_head_weight, bias), softcap, temperature)
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
    softcap: float | None = None,
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
                yield rows, softcapped_(torch.nn.functional.linear(stacked, weight, bias), softcap, temperature)

    normaliser = torch.full((num_removed + 1, num_tokens), -math.inf, device=device)
    for rows, logits in tiled_logits():
        normaliser[:, rows] = torch.logaddexp(normaliser[:, rows], torch.logsumexp(logits, dim=-1))
    total = torch.zeros(num_removed, num_tokens, dtype=torch.float32, device=device)
    for rows, logits in tiled_logits():
        logprobs = logits.sub_(normaliser[:, rows, None])
        total[:, rows] += _js_terms(logprobs[0], logprobs[1:])
    return ((0.5 / LN2) * total).clamp_(0.0, 1.0)
