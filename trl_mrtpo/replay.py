"""No-grad replay of sampled completions under several contexts, returning per-token relevance q (docs/method.md
step 4).

The same completion tokens are teacher-forced after ``P_all`` and after each ``P_not_k`` with the sampling-time
weights, dropout off and the sampling temperature. The contexts of a batch form a prefix tree: every prefix that
several contexts share (a group's prompt; everything before a removed block or span; identical contexts of the
responses of a group) is run once and its key/value cache reused; then each sequence runs only its last context
token and its completion, batched with the sequences of the same context. The last hidden states at completion
positions go through :func:`trl_mrtpo.ops.replay_divergence`.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import weakref
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.cache_utils import DynamicCache
from transformers.utils import logging

from ._trl import (
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
    gathered_for_probe,
    maybe_gather_lm_head_ctx,
)
from .constants import MIN_SHARED_PREFIX, PACKED_ROW_TOKENS, PROBE_HALF_TOLERANCE, REPLAY_BATCH_SIZE
from .info_blocks import removed_groups
from .ops.divergence import device_rule_applies, divergence_backend, stacked_divergence
from .ops.js import softcapped_
from .state import Stateful

logger = logging.get_logger(__name__)


def causal_lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    """The decoder (returning last hidden states) and the lm_head of a causal LM, PEFT-wrapped or not.

    Under LoRA the adapter layers live inside the decoder, so the replay sees the adapted policy.
    """
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    get_decoder = getattr(model, "get_decoder", None)
    # transformers' get_decoder falls back to the model itself where its base_model_prefix names no attribute
    # (Llama 4's causal LM): the decoder is then the backbone under `model`
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    candidates = (get_decoder() if callable(get_decoder) else None, getattr(model, "model", None))
    # ... and never the head (ModernBERT-decoder's head is an attribute named `decoder`)
    decoder = next((m for m in candidates if isinstance(m, nn.Module) and m is not model and m is not head), None)
    if decoder is None or head is None:
        raise ValueError(
            f"MRTPO replay needs a causal LM with get_decoder() and get_output_embeddings(); "
            f"{type(model).__name__} does not provide them."
        )
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):  # a PEFT layer around the lm_head
        raise ValueError(
            f"MRTPO replay reads the lm_head weight directly, but the output layer carries a PEFT adapter "
            f"({type(head).__name__}: lm_head in the adapter's target_modules). Leave lm_head out of them."
        )
    # a subclass is fine: FSDP2 swaps a module's class for an nn.Linear subclass that gathers its shards
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"MRTPO replay reads the lm_head weight directly, but the output layer is a {type(head).__name__}, "
            "not a linear layer."
        )
    return decoder, head


def final_logit_softcap(model: nn.Module) -> float | None:
    """The model's ``final_logit_softcapping`` (Gemma 2: its forward returns ``cap * tanh(z / cap)``; xLSTM names it
    ``output_logit_soft_cap``), or None."""
    if hasattr(model, "get_base_model"):  # peft.PeftModel
        model = model.get_base_model()
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", lambda: config)()
    cap = getattr(text, "final_logit_softcapping", None) or getattr(text, "output_logit_soft_cap", None)
    return float(cap) if cap else None


def declared_logit_multiplier(config) -> float | None:
    """The factor a model's config declares its forward applies to the logits: Granite divides by
    ``logits_scaling``, Cohere multiplies by ``logit_scale``; None when the config declares neither."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling:
        return 1.0 / float(scaling)
    scale = getattr(config, "logit_scale", None)
    return float(scale) if scale else None


@torch.no_grad()
def logit_multiplier(model: nn.Module) -> float:
    """The factor ``m`` with ``model(x).logits == m * lm_head(decoder(x))``, checked on a two-token input at the
    model's own precision.

    The replay applies the lm_head itself, so a model that scales its logits inside ``forward`` (Granite's
    ``logits_scaling``, Cohere's ``logit_scale``, ...) is replayed at temperature ``T / m`` to see the distribution
    it samples from. The factor the config declares (1 when it declares none) is returned exactly when the forward
    agrees with it within the rounding of the logits' dtype (bf16 rounds each logit by up to 2^-8 of its size);
    otherwise a linear factor is fitted. A declared ``final_logit_softcapping`` is applied to the raw logits before
    the comparison (the replay applies it too); any other non-linear transform has no factor and is refused.
    """
    decoder, head = causal_lm_parts(model)
    softcap = final_logit_softcap(model)
    device = next(model.parameters()).device
    input_ids = torch.tensor([[1, 2]], device=device)
    with eval_mode(model), lm_head_parameters(model) as (weight, bias):
        try:
            logits = model(input_ids=input_ids, use_cache=False).logits
            hidden = decoder(input_ids=input_ids, use_cache=False).last_hidden_state.double()
        except Exception as error:  # refused by name at start-up, not inside a training step
            raise ValueError(
                f"MRTPO replay could not run {type(model).__name__} or its decoder on a two-token start-up probe "
                f"({type(error).__name__}: {error}); the model is not supported."
            ) from error
        if hidden.shape[-1] != weight.shape[-1]:
            raise ValueError(
                f"MRTPO replay applies the lm_head to the decoder's last hidden state, but {type(model).__name__}'s "
                f"lm_head takes {weight.shape[-1]} features and its decoder returns {hidden.shape[-1]} (a projection "
                "between them, inside forward); the model is not supported."
            )
        raw = softcapped_(hidden @ weight.double().T + (bias.double() if bias is not None else 0.0), softcap, 1.0)
    if not (torch.isfinite(logits).all() and torch.isfinite(raw).all()):
        raise ValueError(
            f"The logits of {type(model).__name__} overflow {logits.dtype} (inf or NaN on a two-token probe): neither "
            "sampling nor the replay could read them. Load the model in bfloat16 or float32 (dtype=...)."
        )
    # two roundings to the model's dtype (the matmul, then a scale applied after it), never tighter than fp32's 1e-3:
    # the weights' dtype, not the logits' (Mllama and Beam return bf16 logits upcast to fp32)
    rtol = max(1e-3, 2 * torch.finfo(weight.dtype).eps)
    logits = logits.double()
    atol = rtol * logits.abs().max().item() / 10 + 1e-12

    def agrees(scale: float) -> bool:
        return torch.allclose(logits, scale * raw, rtol=rtol, atol=atol)

    declared = declared_logit_multiplier(model.config)
    expected = 1.0 if declared is None else declared
    if agrees(expected):
        return expected
    fitted = ((logits * raw).sum() / (raw * raw).sum().clamp(min=1e-30)).item()
    if agrees(fitted):
        return fitted
    raise ValueError(
        f"MRTPO replay computes logits from the last hidden state and the lm_head weight, but "
        f"{type(model).__name__} transforms its logits non-linearly inside forward (a prediction-head transform, a "
        "soft-capping its config does not declare), so the replay would not see the sampling distribution. Such "
        "models are not supported yet."
    )


def refuse_tensor_parallel(model: nn.Module) -> None:
    """Tensor parallelism is refused by name: the replay's decoder forwards run only on the processes that have pairs
    to replay, and a tensor-parallel forward's collectives would wait for the others."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    size = getattr(base, "_tp_size", None) or getattr(getattr(base, "config", None), "tp_size", None)
    if size is not None and size > 1:
        raise ValueError(
            f"MRTPO replay does not support tensor parallelism ({type(base).__name__} is sharded over {size} "
            "processes: tp_plan): its forwards run only where pairs are replayed. Shard with FSDP2 or ZeRO instead."
        )


def replay_settings(policy: nn.Module, temperature: float, backend: str, max_removed: int = 1) -> tuple[float, str]:
    """The temperature the replay divides its own lm_head logits by, and the divergence backend it runs, settled
    once at start-up on every process (a sharded model is gathered for the probe).

    The temperature is ``T / m`` for a model that scales its logits in forward (:func:`logit_multiplier`). The path the
    replay runs this model by is checked against its own forward (:func:`check_replay_path`). On CUDA the
    projection both backends share is checked against float64 first
    (:func:`~trl_mrtpo.ops.device_rule.check_projection`). A named backend runs its start-up check on the real lm_head
    and is warmed for every number of removed contexts up to ``max_removed``. ``"auto"`` is ``"torch"`` except on
    CUDA with Triton, where the kernel is taken only when its check passes and it is faster than the torch rule on
    the real shape (:func:`trl_mrtpo.ops.triton_divergence.check_kernel`, ``time_against_torch``), agreed by every
    process. Tensor parallelism is refused (:func:`refuse_tensor_parallel`).
    """
    refuse_tensor_parallel(policy)
    with gathered_for_probe(policy):
        multiplier = logit_multiplier(policy)
        check_replay_path(policy, multiplier)
        temperature = temperature / multiplier
        softcap = final_logit_softcap(policy)
        with lm_head_parameters(policy) as (weight, bias):
            if device_rule_applies(weight):
                from .ops.device_rule import check_projection

                check_projection(weight, bias, temperature, softcap)
            checked = backend == "auto"  # auto checks the kernel before it takes it
            if backend == "auto":  # the kernel's module is imported on CUDA only: off it, auto is torch
                if not weight.is_cuda:
                    return temperature, "torch"
                from .ops.triton_divergence import auto_backend

                backend = auto_backend(weight, bias, temperature, softcap)
            named = divergence_backend(backend)
            if named is not None and named.check is not None and not checked:
                named.check(weight, bias, temperature, softcap)
            if named is not None and named.warm is not None:
                named.warm(weight, bias, temperature, softcap, max_removed)
    return temperature, backend


@dataclass(frozen=True)
class ReplayPath:
    """How the replay runs a model: several sequences packed side by side in one row, each restarting its positions
    after a shared prefix (``packs``), and context prefixes run once and reused through the key/value cache
    (``shares_prefix``); ``reason`` says why a faster path is off (empty when both are on)."""

    packs: bool = True
    shares_prefix: bool = True
    reason: str = ""

    def describe(self) -> str:
        if self.packs:
            return "packed rows" + (" through a shared prefix" if self.shares_prefix else "")
        return "one sequence per row" + (" through a shared prefix" if self.shares_prefix else ", no prefix sharing")


# the path of each model the replay has run or checked, by its decoder (a model's own, dropped with it)
_PATHS: weakref.WeakKeyDictionary[nn.Module, ReplayPath] = weakref.WeakKeyDictionary()


def declares_alibi(config) -> bool:
    """Whether a config declares ALiBi position biases (Falcon's ``alibi``, MPT's ``attn_config.alibi``, a dict in
    remote-code configs, or ``position_embedding_type="alibi"``): they follow a key's column in the row."""
    attention = getattr(config, "attn_config", None)
    nested = attention.get("alibi") if isinstance(attention, dict) else getattr(attention, "alibi", None)
    flags = (getattr(config, "alibi", None), nested, getattr(config, "position_embedding_type", None))
    return any(flag is True or flag == "alibi" for flag in flags)


@torch.no_grad()
def rule_path(model: nn.Module) -> ReplayPath:
    """The path the model's config, attention and cache allow (docs/method.md, step 4, "The replay's path").

    Packing needs positions read from ``position_ids`` (rotary or learned absolute: a packed sequence restarts them;
    ALiBi follows a key's column in the row instead) and an attention that takes a dense mask (SDPA, eager; flash
    kernels take none). Packing and prefix sharing need transformers' own dynamic cache of attention layers: a
    state-space or linear-attention layer carries one state through the row, which can neither be split between
    packed sequences nor re-entered by several continuations of a prefix; a cache class of the model's own, or none,
    hides what its layers keep.
    """
    decoder = _Decoder(model, ReplayPath())
    with eval_mode(model):  # the cache a two-token forward returns
        out = decoder.decoder(input_ids=torch.tensor([[1, 2]], device=decoder.device), use_cache=True)
    cache = out.get(decoder.cache_arg, out.get("past_key_values")) if hasattr(out, "get") else None
    if type(cache) is not DynamicCache:  # None, or a cache class of the model's own (MiniMax keeps state beside it)
        held = f"a {type(cache).__name__}" if cache is not None else "no key/value cache"
        return ReplayPath(False, False, f"its decoder returns {held}, whose state the rule cannot see")
    stateful = [
        type(layer).__name__
        for layer in cache.layers
        if isinstance(layer, LinearAttentionCacheLayerMixin) or not isinstance(layer, DynamicLayer)
    ]
    if stateful:
        reason = f"its cache holds {stateful[0]} layers, whose state runs through a whole row"
        return ReplayPath(False, False, reason)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not decoder.takes_positions:
        return ReplayPath(False, True, "its decoder takes no position_ids")
    if declares_alibi(config):
        return ReplayPath(False, True, "its config declares ALiBi, which follows a key's column in a row")
    if decoder.mask is None:
        return ReplayPath(False, True, f"its attention ({config._attn_implementation}) takes no dense mask")
    return ReplayPath()


def replay_path(model: nn.Module) -> ReplayPath:
    """The path the replay runs ``model`` by: the one :func:`check_replay_path` settled, else :func:`rule_path`'s."""
    decoder, _ = causal_lm_parts(model)
    if decoder not in _PATHS:
        _PATHS[decoder] = rule_path(model)
    return _PATHS[decoder]


def probe_mismatch(model: nn.Module, multiplier: float) -> float:
    """The largest difference between the logits the replay computes and the model's own forward, relative to the
    largest logit, on a probe of two contexts sharing a prefix and two completions of different lengths (each
    context with each completion: 4 sequences, about 110 positions), replayed by the model's current path."""
    _, head = causal_lm_parts(model)
    gen = torch.Generator().manual_seed(0)
    embeddings = model.get_input_embeddings()  # a head may have more rows than the embedding (Inkling 2)
    high = min(head.out_features, getattr(embeddings, "num_embeddings", head.out_features), 1000)

    def ids(n: int) -> list[int]:
        return torch.randint(min(3, high - 1), high, (n,), generator=gen).tolist()

    prefix, block, tail = ids(MIN_SHARED_PREFIX + 2), ids(4), ids(2)
    contexts = [prefix + block + tail, prefix + tail]
    completions = [ids(5), ids(9)]
    pairs = [(context, completion) for completion in completions for context in contexts]
    states = completion_hidden_states(model, [c for c, _ in pairs], [y for _, y in pairs], REPLAY_BATCH_SIZE)
    softcap = final_logit_softcap(model)
    device = next(model.parameters()).device
    worst = 0.0
    with eval_mode(model), lm_head_parameters(model) as (weight, bias):
        for (context, completion), hidden in zip(pairs, states):
            replayed = hidden.float() @ weight.float().T + (bias.float() if bias is not None else 0.0)
            replayed = softcapped_(replayed, softcap, 1.0)  # as the model's forward applies it
            positions = slice(len(context) - 1, len(context) - 1 + len(completion))
            plain = model(input_ids=torch.tensor([context + completion], device=device), use_cache=False)
            plain = plain.logits[0, positions].float()
            scale = plain.abs().max().clamp(min=1e-30)
            worst = max(worst, ((multiplier * replayed - plain).abs().max() / scale).item())
    return worst


def check_replay_path(model: nn.Module, multiplier: float = 1.0) -> ReplayPath:
    """The start-up check on the user's own model (docs/method.md, step 4, "The replay's path"): the path of
    :func:`rule_path` replays a probe (:func:`probe_mismatch`), compared with the model's own forward at its dtype.
    Where it disagrees, the replay runs one sequence per row; where that disagrees too, without prefix sharing; where
    even that disagrees, or a forward fails, the model is refused naming its class and what failed. A fallback is
    logged once; the settled path is the one every later replay of this model runs."""
    decoder, head = causal_lm_parts(model)
    dtype = head.weight.dtype
    tolerance = 1e-3 if torch.finfo(dtype).bits >= 32 else PROBE_HALF_TOLERANCE
    try:
        rule = rule_path(model)
    except Exception as error:  # a decoder that cannot run a cached forward: checked without the cache below
        rule = ReplayPath(False, False, f"a cached forward of its decoder fails ({type(error).__name__}: {error})")
    candidates = [rule]
    if rule.packs:
        candidates.append(ReplayPath(False, rule.shares_prefix, "packed rows disagree with its forward"))
    if candidates[-1].shares_prefix:
        candidates.append(ReplayPath(False, False, "replays through a shared prefix disagree with its forward"))
    failures = []
    for path in candidates:
        _PATHS[decoder] = path
        try:
            mismatch = probe_mismatch(model, multiplier)
        except Exception as error:
            failures.append(f"{path.describe()}: {type(error).__name__}: {error}")
            continue
        if mismatch <= tolerance:
            if path != candidates[0] or path.reason:
                logger.warning(
                    f"MRTPO replays {type(model).__name__} with {path.describe()} ({path.reason}); "
                    + (f"before it: {'; '.join(failures)}" if failures else "as its configuration allows")
                )
            return path
        failures.append(f"{path.describe()}: logits off by {mismatch:.3g} of the largest (tolerance {tolerance:g})")
    del _PATHS[decoder]
    raise ValueError(
        f"MRTPO replay cannot reproduce {type(model).__name__}'s own forward, so its credit would be wrong; the "
        f"model is not supported. On a start-up probe: {'; '.join(failures)}."
    )


@contextmanager
def eval_mode(model: nn.Module):
    """Dropout off for the replay, restoring the previous mode afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@dataclass
class ContextNode:
    """A node of the prefix tree of replay contexts: ``tokens`` extend the parent's prefix; ``children`` are keyed
    by the first token of their own segment; ``sequences`` are the (context, completion) pairs whose context,
    without its last token, ends exactly here."""

    tokens: list[int]
    children: dict[int, ContextNode] = field(default_factory=dict)
    sequences: list[int] = field(default_factory=list)

    def consumers(self) -> int:
        """Forwards that would continue from this node's prefix: one per child and one per sequence."""
        return len(self.children) + len(self.sequences)


def context_tree(contexts: Sequence[Sequence[int]]) -> ContextNode:
    """The radix tree of the contexts without their last token (that token's state predicts completion token 0, so
    it always runs with the completion). Contexts that share a prefix share the nodes of that prefix: ``P_all`` and
    ``P_not_k`` share everything before block (or span) k, ``P_not_j`` and ``P_not_k`` everything before the earlier
    of the two, and the responses of a group their prompt and every identical context."""
    root = ContextNode([])
    for index, context in enumerate(contexts):
        node, key = root, list(context[:-1])
        while key:
            child = node.children.get(key[0])
            if child is None:
                child = node.children[key[0]] = ContextNode(key)
                node = child
                break
            common = 1  # the child was found by its first token
            while common < min(len(child.tokens), len(key)) and child.tokens[common] == key[common]:
                common += 1
            if common < len(child.tokens):  # split: the shared part stays, the rest becomes its only child
                rest = ContextNode(child.tokens[common:], child.children, child.sequences)
                child.tokens, child.children, child.sequences = child.tokens[:common], {rest.tokens[0]: rest}, []
            node, key = child, key[common:]
        node.sequences.append(index)
    return root


def padded(
    seqs: Sequence[Sequence[int]], device: torch.device | str, left: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded ids and attention mask. Right padding (the default) leaves the positions of real tokens unchanged;
    left padding puts every row's last token in the last column, where generation continues. Padded ids are 0:
    the mask hides them."""
    width = max(1, max(len(s) for s in seqs))
    input_ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(seqs):
        columns = slice(width - len(seq), width) if left else slice(0, len(seq))
        input_ids[row, columns] = torch.tensor(seq, dtype=torch.long, device=device)
        attention_mask[row, columns] = 1
    return input_ids, attention_mask


def packed_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Consecutive indices of ``lengths`` in rows of at most ``capacity`` tokens (a longer sequence alone)."""
    rows, room = [], 0
    for i, length in enumerate(lengths):
        if not rows or length > room:
            rows.append([])
            room = capacity
        rows[-1].append(i)
        room -= length
    return rows


def packed_mask(lengths: Sequence[int], cached: int, additive: torch.dtype | None = None) -> torch.Tensor:
    """``[1, 1, n, cached + n]`` mask of one row packing sequences of ``lengths`` (``n`` tokens in all) after a
    cached prefix: a token sees the prefix and its own sequence up to itself. Boolean (True: seen) for SDPA; for eager
    attention, additive in the model's dtype ``additive`` (0 or its lowest: a float32 mask would promote a bf16
    model's attention weights, which its value product then refuses)."""
    segment = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    local = torch.cat([torch.arange(n) for n in lengths])
    seen = (segment[:, None] == segment[None]) & (local[:, None] >= local[None])
    seen = torch.cat([seen.new_ones(len(seen), cached), seen], dim=1)[None, None]
    if additive is None:
        return seen
    return torch.zeros(seen.shape, dtype=additive).masked_fill_(~seen, torch.finfo(additive).min)


def shared_cache(cache, rows: int):
    """A cache of ``rows`` rows over ``cache``'s key/value tensors, without copying them: a dynamic layer appends by
    concatenation, so a forward on it leaves ``cache`` as it was. Other caches are copied and repeated."""
    if any(type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers):
        shared = copy.deepcopy(cache)
        shared.batch_repeat_interleave(rows)
        return shared
    shared = copy.copy(cache)
    shared.layers = [copy.copy(layer) for layer in cache.layers]
    for layer in (layer for layer in shared.layers if layer.is_initialized):
        layer.keys, layer.values = layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1)
    return shared


class _Decoder:
    """The decoder of a causal LM, run on new tokens after an optional cached prefix of ``cached`` tokens (shared,
    never copied: :func:`shared_cache`). Where its attention takes a custom mask (SDPA, eager) and no sliding window
    is reached, one row packs several sequences (:meth:`packs`)."""

    def __init__(self, model: nn.Module, path: ReplayPath):
        self.decoder, _ = causal_lm_parts(model)
        self.path = path
        self.device = next(model.parameters()).device
        self.dtype = next(self.decoder.parameters()).dtype
        # transformers >= 5.2x renamed `past_key_values` to `cache`
        parameters = inspect.signature(self.decoder.forward).parameters
        self.cache_arg = "cache" if "cache" in parameters else "past_key_values"
        self.takes_positions = "position_ids" in parameters  # ALiBi models read positions from the mask instead
        config = model.config.get_text_config()
        self.mask = {"sdpa": "bool", "eager": "additive"}.get(config._attn_implementation)
        slides = "sliding_attention" in (getattr(config, "layer_types", None) or ("sliding_attention",))
        self.window = getattr(config, "sliding_window", None) if slides else None

    def packs(self, cached: int, width: int) -> bool:
        """Whether rows of ``width`` tokens after ``cached`` may pack several sequences: the attention takes a custom
        mask and every position is within the sliding window, if any (beyond it, the window's own mask is needed).
        Flash attention and other kernels without a dense mask run one sequence per row."""
        return self.path.packs and self.mask is not None and (self.window is None or cached + width < self.window)

    def extend(self, cache, cached: int, tokens: Sequence[int]):
        """The cache after running ``tokens`` on top of ``cache`` (which holds ``cached`` tokens; None: empty)."""
        kwargs = {}
        if cache is not None:
            kwargs = {self.cache_arg: shared_cache(cache, 1)}
            if self.takes_positions:
                kwargs["position_ids"] = torch.arange(cached, cached + len(tokens), device=self.device)[None]
        out = self.decoder(input_ids=torch.tensor([list(tokens)], device=self.device), use_cache=True, **kwargs)
        return out[self.cache_arg] if self.cache_arg in out else out.past_key_values

    def hidden(self, cache, cached: int, rows: Sequence[Sequence[int]], packed: bool = False) -> torch.Tensor:
        """``[len(rows), width, H]`` last hidden states of right-padded ``rows`` after the shared cached prefix; with
        ``packed``, ``[1, width, H]`` of the rows side by side in one row, each seeing only the prefix and itself."""
        lengths = [len(row) for row in rows]
        input_ids, attention_mask = padded([[t for row in rows for t in row]] if packed else rows, self.device)
        kwargs, (count, width) = {"use_cache": False}, input_ids.shape  # no cache without a prefix: it is thrown away
        if cache is not None:
            kwargs = {self.cache_arg: shared_cache(cache, count), "use_cache": True}
        if packed:  # each sequence restarts its positions after the prefix
            kwargs["position_ids"] = cached + torch.cat([torch.arange(n) for n in lengths])[None].to(self.device)
            additive = self.dtype if self.mask == "additive" else None
            attention_mask = packed_mask(lengths, cached, additive).to(self.device)
        elif cache is not None:
            if self.takes_positions:
                kwargs["position_ids"] = torch.arange(cached, cached + width, device=self.device).expand(count, -1)
            attention_mask = torch.cat([attention_mask.new_ones(count, cached), attention_mask], dim=1)
        return self.decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state


@torch.no_grad()
def completion_hidden_states(
    model: nn.Module,
    contexts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    batch_size: int,
    min_shared_prefix: int | None = MIN_SHARED_PREFIX,
    store: Callable[[int, torch.Tensor], None] | None = None,
    max_tokens: int | None = None,
) -> list[torch.Tensor] | None:
    """Last hidden states ``[L_i, H]`` predicting each completion token, for each (context_i, completion_i) pair;
    with ``store``, each pair's states are handed to ``store(i, states)`` as a view of the forward's output (to copy
    where it keeps them) and nothing is returned.

    With ``min_shared_prefix`` set, the contexts form a prefix tree (:func:`context_tree`) walked depth first: a
    prefix that at least two forwards continue from and that has at least ``min_shared_prefix`` new tokens is run
    once and its key/value cache reused below it; shorter ones are carried into the forwards below. Sequences with
    the same context run together from its cache. Where the attention allows (:meth:`_Decoder.packs`) they are packed
    (:func:`packed_rows`) into rows of :data:`PACKED_ROW_TOKENS` (or the longest sequence, or ``max_tokens`` when
    fewer), one row per forward, so that no position is computed for padding; otherwise a forward takes at most
    ``batch_size`` sequences, right-padded, and with ``max_tokens`` at most that many tokens (one sequence at least).
    ``None`` runs every sequence whole, one per row, sorted by length, in mini-batches (the reference the tree is
    tested against). A model's :func:`replay_path` may turn packing or prefix sharing off.
    """
    decoder = _Decoder(model, replay_path(model))
    if not decoder.path.shares_prefix:
        min_shared_prefix = None
    out: list[torch.Tensor | None] = [None] * len(contexts)

    def run(indices: Sequence[int], cache, cached: int, pending: Sequence[int], pack: bool = True) -> None:
        """Sequences whose context is ``cache``'s prefix + ``pending`` + their own rest, packed or batched."""
        order = sorted(indices, key=lambda i: -(len(contexts[i]) + len(completions[i])))
        rest = {i: [*pending, *contexts[i][cached + len(pending) :], *completions[i]] for i in order}
        width = len(rest[order[0]]) if order else 0  # the widest row's
        # packed where rows would pad (one length pads nothing), one row per forward (rows of one forward would pad)
        packed = pack and len({len(r) for r in rest.values()}) > 1 and decoder.packs(cached, width)
        if packed:
            capacity = max(width, min(PACKED_ROW_TOKENS, max_tokens or PACKED_ROW_TOKENS))
            chunks = [[order[k] for k in row] for row in packed_rows([len(rest[i]) for i in order], capacity)]
        else:
            per_forward = min(batch_size, max(1, max_tokens // max(width, 1))) if max_tokens else batch_size
            chunks = [order[start : start + per_forward] for start in range(0, len(order), per_forward)]
        for chunk in chunks:
            hidden = decoder.hidden(cache, cached, [rest[i] for i in chunk], packed)
            starts = itertools.accumulate((len(rest[i]) for i in chunk), initial=0) if packed else itertools.repeat(0)
            for row, (i, offset) in enumerate(zip(chunk, starts)):
                first = len(contexts[i]) - cached - 1 + offset  # the last context token's state predicts token 0
                states = hidden[0 if packed else row, first : first + len(completions[i])]
                if store is not None:
                    store(i, states)
                else:  # a copy: a view would keep the whole batch's [rows, width, H] states alive until the JS
                    out[i] = states.clone()

    def walk(root: ContextNode) -> None:
        """Depth first, children in order (a stack, not recursion: a recursive closure is a reference cycle that
        would hold the states until a garbage collection)."""
        stack = [(root, None, 0, [])]
        while stack:
            node, cache, cached, pending = stack.pop()
            pending = pending + node.tokens
            if node.consumers() > 1 and len(pending) >= max(min_shared_prefix, 1):
                cache, cached, pending = decoder.extend(cache, cached, pending), cached + len(pending), []
            if node.sequences:
                run(node.sequences, cache, cached, pending)
            stack.extend((child, cache, cached, pending) for child in reversed(node.children.values()))

    with eval_mode(model):
        if min_shared_prefix is None:
            run(range(len(contexts)), None, 0, [], pack=False)
        else:
            walk(context_tree(contexts))
    return None if store is not None else out


@contextmanager
def lm_head_parameters(model: nn.Module):
    """``(weight, bias)`` of the lm_head as full tensors, gathered while in the context when ZeRO-3 or FSDP2 shard
    them (the replay reads the weight directly)."""
    _, head = causal_lm_parts(model)
    with maybe_gather_lm_head_ctx(head.weight, head.bias):
        weight, bias = head.weight, head.bias
        if isinstance(weight, DTensor):
            weight = weight.full_tensor()
            bias = bias.full_tensor() if bias is not None else None
        yield weight, bias


class ReplayMemory(Stateful):
    """The bytes usable on the device when the run first replays on CUDA (free, plus reserved and unused), from which
    the replay's chunk rows and streams follow (:func:`replay_relevance`'s ``usable_bytes``): fixed for the run, and
    kept in checkpoints so that a resumed run chunks and streams as before where its card has that much usable; each
    process measures its own card once, and a resumed one takes the smaller of the two figures."""

    state_entries = ("usable_bytes",)

    def __init__(self):
        self.usable_bytes: int | None = None
        self.measured = False  # this process has measured its card (never from a checkpoint)

    def decide(self, device: torch.device, model: nn.Module) -> int | None:
        """The run's usable bytes on ``device``, measured (and logged) at this process's first replay; None off
        CUDA."""
        if device.type != "cuda":
            return None
        if not self.measured:
            from .ops.device_rule import run_usable_memory

            usable = run_usable_memory(device, causal_lm_parts(model)[1].out_features)
            if self.usable_bytes is not None and usable < self.usable_bytes:
                logger.warning(
                    f"MRTPO's replay was sized from {self.usable_bytes / 2**30:.1f} GiB usable when this run was "
                    f"checkpointed; {device} has {usable / 2**30:.1f} GiB usable now, which sizes it from here on."
                )
            self.usable_bytes = usable if self.usable_bytes is None else min(self.usable_bytes, usable)
            self.measured = True
        return self.usable_bytes


def replay_streams(sizes: Sequence[tuple[int, int]], states_bytes: int | None) -> list[list[int]]:
    """Consecutive responses in streams whose hidden states (``sizes[i]``: response, bytes) take at most
    ``states_bytes`` together (a larger response alone); one stream when ``states_bytes`` is None. The responses of
    a group, consecutive, stay together as far as the budget allows: what they share is computed once per stream."""
    streams: list[list[int]] = []
    held = 0
    for j, size in sizes:
        if not streams or (states_bytes is not None and held + size > states_bytes and streams[-1]):
            streams.append([])
            held = 0
        streams[-1].append(j)
        held += size
    return streams


@torch.no_grad()
def replay_relevance(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    temperature: float,
    batch_size: int = REPLAY_BATCH_SIZE,
    chunk_size: int | None = None,
    min_shared_prefix: int | None = MIN_SHARED_PREFIX,
    backend: str = "torch",
    usable_bytes: int | None = None,
) -> list[torch.Tensor]:
    """Relevance q for every replayed context of every response.

    Lean replay: the responses run in streams of at most a share of ``usable_bytes`` of hidden states
    (:func:`replay_streams`, :func:`~trl_mrtpo.ops.device_rule.budget_states_bytes`; one stream without it). A
    stream's contexts form one prefix tree whose shared prefixes run once (see :func:`completion_hidden_states`); its
    states are written once, into one ``[N, contexts, H]`` buffer per number of contexts, which the divergence reads
    as views, and released before the next stream; each response's ``P_all`` is shared by its rewards.

    Args:
        model: the policy (sampling-time weights).
        contexts: per response j, token ids ``[P_all, P_removed_1, ..., P_removed_m]``; responses with fewer
            than two contexts are skipped.
        completions: per response j, its completion token ids (unpadded).
        temperature: sampling temperature.
        batch_size: sequences per replay forward.
        chunk_size: tokens per divergence chunk (see :func:`replay_divergence`).
        min_shared_prefix: fewest new tokens a shared prefix needs for its own cached forward; None turns prefix
            reuse off.
        backend: divergence backend (see :func:`replay_divergence`; ``auto`` is settled by :func:`replay_settings`).
        usable_bytes: the run's usable memory on CUDA (:class:`ReplayMemory`), which sizes the streams and the
            divergence's chunk rows (:func:`~trl_mrtpo.ops.device_rule.budget_chunk_rows`); None: one stream, and
            chunks by the device's rule at each call.

    Returns:
        per response j, ``[m_j, L_j]`` fp32 q (``[0, L_j]`` when nothing is replayed).
    """
    results = [torch.zeros(0, len(c)) for c in completions]
    if len(contexts) != len(completions):
        raise ValueError(f"{len(contexts)} context lists for {len(completions)} completions")
    _, head = causal_lm_parts(model)
    state_bytes = head.in_features * head.weight.element_size()  # per token and context (a ZeRO-3 weight is empty)
    sizes = [
        (j, len(ctx) * len(completion) * state_bytes)
        for j, (ctx, completion) in enumerate(zip(contexts, completions))
        if len(ctx) >= 2 and len(completion) > 0
    ]
    softcap = final_logit_softcap(model)
    states_bytes = forward_tokens = None
    if usable_bytes is not None:
        from .ops.device_rule import budget_chunk_rows, budget_forward_tokens, budget_states_bytes

        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        states_bytes = budget_states_bytes(usable_bytes)
        forward_tokens = budget_forward_tokens(usable_bytes, base.config.get_text_config(), head.weight.element_size())
    for stream in replay_streams(sizes, states_bytes):
        buffers = stream_states(model, contexts, completions, stream, batch_size, min_shared_prefix, forward_tokens)
        with lm_head_parameters(model) as (weight, bias):
            rows = budget_chunk_rows(usable_bytes, weight.shape[0]) if usable_bytes is not None else None
            for count in list(buffers):  # popped: each buffer is released once read
                members, stacked = buffers.pop(count)
                q = stacked_divergence(stacked, weight, bias, temperature, chunk_size, backend, softcap, rows)
                del stacked  # before the next stream's forwards
                for j, part in zip(members, q.split([len(completions[j]) for j in members], dim=1)):
                    results[j] = part
    return results


def stream_states(
    model: nn.Module,
    contexts: Sequence[Sequence[Sequence[int]]],
    completions: Sequence[Sequence[int]],
    stream: Sequence[int],
    batch_size: int,
    min_shared_prefix: int | None,
    max_tokens: int | None = None,
) -> dict[int, tuple[list[int], torch.Tensor]]:
    """The hidden states of the responses ``stream``, by number of contexts: its responses and one ``[N, contexts,
    H]`` buffer (their completion tokens in order, each context's states written in place), from one prefix tree."""
    by_count: dict[int, list[int]] = {}
    for j in stream:
        by_count.setdefault(len(contexts[j]), []).append(j)
    offsets = {}  # each response's first token in its buffer
    for members in by_count.values():
        for j, first in zip(members, itertools.accumulate((len(completions[j]) for j in members), initial=0)):
            offsets[j] = first
    flat_contexts, flat_completions, slots = [], [], []  # in response order; slots: (contexts, first token, context)
    for j in stream:
        for c, context in enumerate(contexts[j]):
            flat_contexts.append(context)
            flat_completions.append(completions[j])
            slots.append((len(contexts[j]), offsets[j], c))
    buffers: dict[int, torch.Tensor] = {}

    def store(i: int, states: torch.Tensor) -> None:
        count, first, c = slots[i]
        if count not in buffers:  # allocated at the first state, in the states' dtype
            tokens = sum(len(completions[j]) for j in by_count[count])
            buffers[count] = states.new_empty(tokens, count, states.shape[-1])
        buffers[count][first : first + len(states), c] = states

    completion_hidden_states(model, flat_contexts, flat_completions, batch_size, min_shared_prefix, store, max_tokens)
    return {count: (members, buffers.pop(count)) for count, members in by_count.items()}


def placed_relevance(
    q: Sequence[torch.Tensor],
    wanted: Sequence[Sequence[int]],
    mask: torch.Tensor,
    num_rewards: int,
    joint: bool = False,
    groups: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4's q laid out per (response, reward): ``[B, K, C]`` relevance and ``[B, K]`` replayed, from
    :func:`replay_relevance`'s rows (one per information group of ``wanted[j]``, in the order of
    :func:`~trl_mrtpo.info_blocks.removed_groups`, or one shared row when ``joint``): every wanted member of a group
    gets its group's row. ``groups`` None: each reward is its own group. Zero where ``mask`` (``[B, C]``) is 0: tool
    results are context, not the model's decisions."""
    relevance = torch.zeros(mask.shape[0], num_rewards, mask.shape[1], device=mask.device)
    replayed = torch.zeros(mask.shape[0], num_rewards, dtype=torch.bool, device=mask.device)
    for j, rewards in enumerate(wanted):
        length = q[j].shape[-1] if j < len(q) else 0
        sample_groups = groups[j] if groups is not None else range(num_rewards)
        rows = {g: row for row, g in enumerate(removed_groups(rewards, sample_groups))}
        for k in rewards if length else ():
            relevance[j, k, :length] = q[j][0 if joint else rows[sample_groups[k]]].to(mask.device)
            replayed[j, k] = True
    return relevance * mask[:, None, :].to(relevance.dtype), replayed
