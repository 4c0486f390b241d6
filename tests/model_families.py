"""Tiny random models of every causal-LM family transformers ships, built offline from their config classes, for the
family sweep (tests/test_model_families.py) and the table of docs/compatibility.md (``python -m
tests.model_families`` rewrites it).

The families are transformers' own auto mapping of causal LMs (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``), so a new
release brings its families in by itself. Each gets the same small sizes (:data:`TINY`: two layers, width 32), with
a family's own fields where its config needs them (:data:`FAMILY_FIELDS`), and weights drawn at
``initializer_range`` 0.2 so that its next-token distributions differ from context to context (at the families'
default 0.02 they are nearly uniform and every q is below 1e-4 bits).
"""

from __future__ import annotations

import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.helpers import time_limit
from tests.reference import full_logits_relevance

TINY = {
    "vocab_size": 320,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "n_shared_experts": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "v_head_dim": 8,
    "rotary_dim": 4,
    "decoder_layers": 2,  # the encoder-decoder families' decoders (and encoders)
    "encoder_layers": 2,
    "num_decoder_layers": 2,
    "num_encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 64,
    "encoder_ffn_dim": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
# Multi-head latent attention (a config with ``kv_lora_rank``): one key/value head per query head, one expert group.
LATENT_ATTENTION = {
    "num_key_value_heads": 4, "n_group": 1, "topk_group": 1, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
}  # fmt: skip
DEFAULT = object()  # a TINY field the family's config refuses: left at its default
QWEN4 = {
    "layer_types": ["linear_attention", "indexed_attention"], "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "indexer_n_heads": 2, "indexer_kv_heads": 1,
    "indexer_head_dim": 8, "indexer_budget": 8, "indexer_compress_ratio": 2,
}  # fmt: skip
# What a family's config needs beyond TINY to build and run tiny (hybrids: an attention layer among the two).
FAMILY_FIELDS: dict[str, dict] = {
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "attn_layer_indices": [1], "mamba_d_state": 8},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 16, "layer_types": ["mamba", "attention"]},
    "mamba2": {"num_heads": 4, "head_dim": 16, "n_groups": 1, "state_size": 8},
    "falcon_h1": {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_ssm": 64, "mamba_d_state": 8},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]},
    "bailing_hybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 32},
    "zamba2": {"layer_types": ["mamba", "hybrid"], "hybrid_layer_ids": [1], "mamba_headdim": 16, "n_mamba_heads": 4},
    "zaya": {"num_experts_per_tok": 1},
    "dots3_note_text": {"num_key_value_heads": 4},
    "dots3_note": {"num_key_value_heads": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 16},
    "kolibri1_1": {"head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1},
    "plbart": {"decoder_attention_heads": 4, "encoder_attention_heads": 4},
    "whisper": {"decoder_attention_heads": 4, "encoder_attention_heads": 4},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0},
    "xlnet": {"max_position_embeddings": DEFAULT},
    "prophetnet": {"num_hidden_layers": DEFAULT},
    "kimi_linear": {
        "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"],
        "linear_head_dim": 8,
        "linear_num_heads": 4,
    },
    "qwen4_exp_text": QWEN4,
    "qwen4_exp": QWEN4,
    "qwen3_5": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe": {"layer_types": ["linear_attention", "full_attention"]},
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "gemma3n_text": {
        "layer_types": ["sliding_attention", "full_attention"],
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 320,
    },
    "gemma4": {"vocab_size_per_layer_input": 320, "hidden_size_per_layer_input": 8},
    "gemma4_text": {"vocab_size_per_layer_input": 320, "hidden_size_per_layer_input": 8},
    "dbrx": {
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "reformer": {
        "is_decoder": True,
        "axial_pos_shape": [16, 32],
        "axial_pos_embds_dim": [16, 16],
        "attn_layers": ["local", "local"],
        "local_attn_chunk_length": 16,
        "attention_head_size": 8,
    },
}
# Configs whose model reads sub-configs: TINY goes to each of these, the family's fields to the text one.
SUB_CONFIG_FIELDS = {
    "vision_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                      "image_size": 32, "patch_size": 8, "depth": 1, "out_hidden_size": 32, "vision_output_dim": 32},
    "audio_config": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4},
}  # fmt: skip
# The transformers release NOT_BUILT and SKIPPED were written for: on another, a family that cannot be built tiny
# is reported, not failed (a later release's new families).
EXPECTATIONS_VERSION = "5.25.0"
# Families whose config or model class refuses the tiny sizes, or that are too large at them (the error's start).
NOT_BUILT: dict[str, str] = {
    "blt": "4,633,189,120 parameters",  # its byte patcher's own sizes
    "cohere_compass_text": "KeyError",
    "dots3_note": "ValueError: `per_layer_config` keys",
    "gemma3n": "ImportError",  # its vision tower needs timm
    "git": "85,878,432 parameters",  # its vision encoder's sizes
    "kolibri1_1": "StrictDataclassClassValidationError",
    "musicgen": "AttributeError",  # a text encoder, an audio codec and a decoder config
    "musicgen_melody": "AttributeError",
    "phi4_multimodal": "869,966,624 parameters",  # its vision and audio towers
    "prophetnet": "NotImplementedError",
    "xlnet": "StrictDataclassClassValidationError",
    "zamba": "StrictDataclassClassValidationError",
}
# Families whose own plain forward fails with their tiny config (the start of the error): reported, not run. None of
# MUST_RUN may be here, and an entry whose family now runs fails the sweep.
SKIPPED: dict[str, str] = {
    "dbrx": "RuntimeError: torch.clamp",
    "gemma4_assistant": "ValueError: inputs_embeds and shared_kv_states cannot be None",  # a draft model's head
    "gemma4_unified_assistant": "ValueError: inputs_embeds and shared_kv_states cannot be None",
    "xmod": "ValueError: Input language unknown",  # set_default_language() first
}
# Families the sweep may never skip: the ones users train most.
MUST_RUN = (
    "llama", "llama4", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3",
    "phi3", "olmo2", "deepseek_v3", "gpt_oss", "granite", "smollm3", "cohere", "mamba", "jamba", "falcon_h1",
)  # fmt: skip
MAX_PARAMETERS = 20_000_000  # beyond it a family is not tiny: reported, not run


def causal_lm_families() -> dict[str, str]:
    """model_type -> class name of every causal LM in transformers' auto mapping."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str, **extra):
    """The family's config at TINY sizes (fields a config refuses to set are left at its defaults)."""
    from transformers import logging
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    latent = LATENT_ATTENTION if "kv_lora_rank" in getattr(config_class, "__dataclass_fields__", {}) else {}
    fields = {**TINY, **latent, **FAMILY_FIELDS.get(model_type, {}), **extra}
    fields = {name: value for name, value in fields.items() if value is not DEFAULT}
    sub_configs = getattr(config_class, "sub_configs", {}) or {}
    nested = {}
    if "text_config" in sub_configs:
        nested["text_config"] = dict(fields)
        for name, sizes in SUB_CONFIG_FIELDS.items():
            if name in sub_configs:
                nested[name] = dict(sizes)
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # "Can't set head_dim ..." for each property the config computes itself
    try:
        for _ in range(len(fields) + 1):
            try:
                return config_class(**fields, **nested)
            except (AttributeError, NotImplementedError) as error:  # a field the config derives or refuses
                found = [name for name in fields if re.search(rf"\b{name}\b", str(error))]
                if not found:
                    raise
                del fields[found[0]]
                if "text_config" in nested:
                    nested["text_config"].pop(found[0], None)
        raise RuntimeError(f"{model_type}: no tiny config")
    finally:
        logging.set_verbosity(verbosity)


def tiny_model(model_type: str, dtype: torch.dtype = torch.float32, **extra):
    """A random tiny model of the family, in eval mode (its class from the auto mapping)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **extra)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise NotTiny(f"{size:,} parameters at the tiny sizes")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


class NotTiny(RuntimeError):
    """The family cannot be built tiny from its config class: reported, not failed."""


@dataclass
class Verdict:
    """What the sweep found for one family: ``exact`` (with the path it replays by), ``refused`` (with the
    refusal), ``not tiny`` or ``skipped``; ``error`` is q's largest difference from plain forwards, ``peak`` q's
    largest value."""

    family: str
    outcome: str
    detail: str = ""
    error: float = math.nan
    peak: float = math.nan


def sweep_batch() -> tuple[list[list[list[int]]], list[list[int]]]:
    """One prompt of 20 tokens with two removable blocks (5 and 4 tokens) before a 3-token tail, and three
    completions of 4, 9 and 13 tokens, each replaying P_all and both removals: the responses share every context,
    and their lengths differ, so the replay packs them and shares the prompt's cache (MIN_SHARED_PREFIX 16)."""
    gen = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 300, (n,), generator=gen).tolist()

    prompt, first, second, tail = ids(20), ids(5), ids(4), ids(3)
    group = [prompt + first + second + tail, prompt + second + tail, prompt + first + tail]
    return [group] * 3, [ids(n) for n in (4, 9, 13)]


def sweep_family(model_type: str) -> Verdict:
    """The family's verdict: its tiny model's replay (after the trainer's start-up settings, at the temperature they
    return) against plain forwards, exact within 1e-3 of the largest q, or its refusal at start-up."""
    from trl_mrtpo.replay import replay_path, replay_relevance, replay_settings

    try:
        model = tiny_model(model_type)
    except NotTiny as error:
        return Verdict(model_type, "not tiny", str(error))
    except Exception as error:  # its config or model class refuses the tiny sizes
        return Verdict(model_type, "not built", f"{type(error).__name__}: {error}".splitlines()[0][:200])
    contexts, completions = sweep_batch()
    try:
        full_logits_relevance(model, contexts[0], completions[0], 1.0)
    except Exception as error:  # the family's own forward: nothing for the replay to reproduce
        return Verdict(model_type, "skipped", f"its plain forward fails: {type(error).__name__}: {error}"[:200])
    try:
        temperature, _ = replay_settings(model, 1.0, "torch")
    except ValueError as error:
        return Verdict(model_type, "refused", str(error))
    q = replay_relevance(model, contexts, completions, temperature, backend="torch")
    error = peak = 0.0
    for context, completion, got in zip(contexts, completions, q):
        reference = full_logits_relevance(model, context, completion, 1.0)
        error = max(error, (got.double() - reference).abs().max().item())
        peak = max(peak, reference.max().item())
    outcome = "exact" if error <= 1e-3 * peak else "wrong"
    path = replay_path(model)
    how = path.describe() + (f" ({path.reason})" if path.reason else "")
    if outcome == "exact" and path.packs:
        problem = bf16_packing_problem(model_type, path)
        if problem:
            return Verdict(model_type, "wrong", f"in bf16: {problem}", error, peak)
        how += ", bf16 too"
    return Verdict(model_type, outcome, how, error, peak)


# bf16 packed against one sequence per row: a token's state is off when it moves by more than BF16_TOKEN_BOUND of its
# largest element, and at most BF16_OFF_SHARE of the tokens may be (isolated MoE router flips)
BF16_TOKEN_BOUND = 0.1
BF16_OFF_SHARE = 0.05


def bf16_packing_problem(model_type: str, path) -> str:
    """What is wrong with the family's packed replay in bf16 ("" when nothing): its start-up check at bf16 must settle
    the fp32 path, and its packed states must agree with one sequence per row within bf16's rounding. bf16 keeps 8
    bits, so summation orders differ by a few units at each layer (Llama: 0.75 % of a state's largest element); a MoE
    router may flip an expert on that noise and move an isolated token further (seen while a float32 packed mask
    promoted eager bf16 attention to fp32: 1 of 78 tokens on MiMo-V2-Flash, by 0.63); packing MPT's ALiBi moves half
    of the tokens, by up to 0.89."""
    from trl_mrtpo.replay import completion_hidden_states, replay_path, replay_settings

    model = tiny_model(model_type, torch.bfloat16)
    replay_settings(model, 1.0, "torch")
    if replay_path(model) != path:
        return f"the start-up check settled {replay_path(model).describe()} ({replay_path(model).reason})"
    contexts, completions = sweep_batch()
    pairs = [(context, completion) for group, completion in zip(contexts, completions) for context in group]
    alls, owned = [c for c, _ in pairs], [y for _, y in pairs]
    packed = completion_hidden_states(model, alls, owned, batch_size=8)
    alone = completion_hidden_states(model, alls, owned, batch_size=1, min_shared_prefix=None)
    moved = torch.cat(
        [(a.float() - b.float()).abs().amax(-1) / b.float().abs().amax(-1) for a, b in zip(packed, alone)]
    )
    off = (moved > BF16_TOKEN_BOUND).float().mean().item()
    return f"{off:.0%} of the packed states are off by more than {BF16_TOKEN_BOUND}" if off > BF16_OFF_SHARE else ""


def compatibility_table(verdicts: list[Verdict]) -> str:
    """The markdown table of docs/compatibility.md's model section (three columns: the options' tables have four)."""
    import transformers

    families = causal_lm_families()
    lines = [
        f"Swept on transformers {transformers.__version__} by `python -m tests.model_families` (which rewrites this "
        "table; `tests/test_model_families.py` holds every family to it):",
        "",
        "| family (class) | outcome | how the replay runs it, or why not |",
        "|---|---|---|",
    ]
    for verdict in verdicts:
        detail = verdict.detail.replace("|", "/").replace("\n", " ")
        lines.append(f"| `{verdict.family}` (`{families[verdict.family]}`) | {verdict.outcome} | {detail} |")
    return "\n".join(lines) + "\n"


TABLE_START, TABLE_END = "<!-- family sweep: start -->", "<!-- family sweep: end -->"


def write_table(path: Path, verdicts: list[Verdict]) -> None:
    """Replaces the text between the sweep's markers in ``path`` by the table."""
    text = path.read_text()
    start, end = text.index(TABLE_START) + len(TABLE_START), text.index(TABLE_END)
    path.write_text(text[:start] + "\n" + compatibility_table(verdicts) + text[end:])


if __name__ == "__main__":
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    found = []
    for family in sys.argv[1:] or causal_lm_families():
        try:
            with time_limit(120):
                verdict = sweep_family(family)
        except Exception as error:
            verdict = Verdict(family, "crash", f"{type(error).__name__}: {error}"[:300])
        found.append(verdict)
        print(f"{verdict.outcome:8} {family}: {verdict.detail[:160]} ({verdict.error:.2e} of {verdict.peak:.2e})",
              flush=True)  # fmt: skip
    if not sys.argv[1:]:
        write_table(Path(__file__).parents[1] / "docs" / "compatibility.md", found)
