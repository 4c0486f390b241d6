"""The replay divergence's entry point and its torch path off CUDA (docs/method.md step 4); the one other backend, the
fused Triton kernel (:mod:`trl_mrtpo.ops.triton_divergence`), is imported only when a run names it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..constants import (
    DEFAULT_CHUNK_ELEMENTS,
    DIVERGENCE_BACKENDS,
    MIN_CHUNK_TOKENS,
)
from .js import js_divergence, softcapped_

# Tests run the device rule on CPU by setting this (everything but the fp32-output GEMM of low-precision operands,
# which only CUDA has: fp32_logits takes its tested fallback, an fp32 GEMM of upcast operands, instead).
_DEVICE_RULE_ON_CPU = False


@dataclass(frozen=True)
class DivergenceBackend:
    """A way to compute :func:`replay_divergence` other than torch's: ``compute(stacked, weight, bias, temperature,
    softcap, chunk_size, chunk_rows)`` returns ``[M, N]`` fp32 q of ``stacked`` (``[N, M + 1, H]``, each token's
    ``P_all`` state then its removed contexts'); ``check(weight, bias, temperature, softcap)`` runs once at start-up on
    the real lm_head and raises when the backend disagrees with the torch rule; ``warm(weight, bias, temperature,
    softcap, max_removed)`` prepares every number of removed contexts up to ``max_removed`` (compiles, say);
    ``missing()`` says what to install when it cannot run here (None: it can)."""

    compute: Callable[..., torch.Tensor]
    check: Callable[..., None] | None = None
    warm: Callable[..., None] | None = None
    missing: Callable[[], str | None] = lambda: None


# backends beside torch: the module whose ``BACKEND`` it is, imported when a run names it (not on the default path)
SHIPPED_BACKENDS = {"triton": "trl_mrtpo.ops.triton_divergence"}


def divergence_backend(name: str) -> DivergenceBackend | None:
    """The backend ``name`` (None for ``"auto"`` and ``"torch"``, this module's), its module imported on first use."""
    if name not in SHIPPED_BACKENDS:
        return None
    return importlib.import_module(SHIPPED_BACKENDS[name]).BACKEND


def chosen_backend(backend: str) -> str:
    """The backend ``replay_divergence`` runs for a name that reached it: ``"auto"`` is ``"torch"`` here (the trainer
    resolves ``auto`` once at start-up, :func:`trl_mrtpo.replay.replay_settings`, and passes what it chose)."""
    return "torch" if backend == "auto" else backend


def device_rule_applies(tensor: torch.Tensor) -> bool:
    """Whether the torch path runs the device rule on ``tensor``'s device: CUDA (or CPU where tests force it)."""
    return tensor.is_cuda or _DEVICE_RULE_ON_CPU


def stacked_states(hidden_all: torch.Tensor, hidden_removed: torch.Tensor) -> torch.Tensor:
    """``[N, M + 1, H]``: each token's ``P_all`` state, then its removed contexts', contiguous (one copy)."""
    return torch.cat([hidden_all[:, None], hidden_removed.transpose(0, 1)], dim=1)


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
      ``P_all``'s log-softmax is computed once per chunk and shared by every removed context. On CUDA the chunk holds
      a fixed number of fp32 vocabulary rows sized from the free memory
      (:func:`~trl_mrtpo.ops.device_rule.device_divergence`); on CPU by :data:`DEFAULT_CHUNK_ELEMENTS`.
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
    stacked = stacked_states(hidden_all, hidden_removed)
    return stacked_divergence(stacked, lm_head_weight, lm_head_bias, temperature, chunk_size, backend, softcap)


def stacked_divergence(
    stacked: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
    softcap: float | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """:func:`replay_divergence` of ``stacked`` (``[N, M + 1, H]``, :func:`stacked_states`), read as views: the
    replay writes its states there once. ``chunk_rows``: fp32 vocabulary rows per chunk of the CUDA rules (None:
    sized from the memory usable now, :func:`~trl_mrtpo.ops.device_rule.budget_chunk_rows`)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap}")
    if backend not in DIVERGENCE_BACKENDS:
        raise ValueError(f"backend must be one of {DIVERGENCE_BACKENDS}, got {backend!r}")
    head = (lm_head_weight, lm_head_bias, temperature)
    if chosen_backend(backend) != "torch":
        return divergence_backend(backend).compute(stacked, *head, softcap, chunk_size, chunk_rows)
    if device_rule_applies(stacked):
        from . import device_rule  # CUDA's path: loaded only where it runs

        return device_rule.device_divergence(stacked, *head, chunk_rows, chunk_size, softcap)
    return _torch_divergence(stacked, *head, chunk_size, softcap)


def _torch_divergence(
    stacked: torch.Tensor,
    lm_head_weight: torch.Tensor,
    lm_head_bias: torch.Tensor | None,
    temperature: float,
    chunk_size: int | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The chunked torch path of :func:`stacked_divergence` off CUDA: fp32 lm_head and JS over token chunks (a weight
    in another dtype goes to :func:`~trl_mrtpo.ops.tiled_divergence.tiled_divergence`, which never holds an fp32 copy
    of the whole lm_head)."""
    if lm_head_weight.dtype != torch.float32:
        from .tiled_divergence import tiled_divergence  # a low-precision head off CUDA: loaded only there

        return tiled_divergence(stacked, lm_head_weight, lm_head_bias, temperature, softcap)
    num_tokens, contexts = stacked.shape[:2]
    vocab = lm_head_weight.shape[0]
    if chunk_size is None:
        chunk_size = max(MIN_CHUNK_TOKENS, DEFAULT_CHUNK_ELEMENTS // (contexts * vocab))
    bias = None if lm_head_bias is None else lm_head_bias.float()
    out = torch.empty(contexts - 1, num_tokens, dtype=torch.float32, device=stacked.device)
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        chunk = stacked[start:end].transpose(0, 1).contiguous().float()  # [M + 1, n, H]
        logits = softcapped_(torch.nn.functional.linear(chunk, lm_head_weight, bias), softcap, temperature)
        logprobs = torch.log_softmax(logits, dim=-1)
        del logits
        out[:, start:end] = js_divergence(logprobs[0], logprobs[1:])
    return out
