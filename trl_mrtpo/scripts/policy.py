"""Loading a policy to evaluate or inspect: a hub id, a local folder or the embedded model, plus a LoRA adapter."""

from __future__ import annotations

import os


def check_policy_folders(model: str, adapter: str | None) -> None:
    """A model folder holds ``config.json`` and an adapter folder ``adapter_config.json``: a folder without them is
    named here, before transformers fails on it with an unrelated message (a missing tokenizer converter)."""
    if os.path.isdir(model) and not os.path.isfile(os.path.join(model, "config.json")):
        raise FileNotFoundError(
            f"--model {model} is a folder without config.json: not a model folder (save_pretrained and save_model "
            "write one)."
        )
    if adapter is not None and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        raise FileNotFoundError(
            f"--adapter {adapter}: no adapter_config.json there; a LoRA adapter folder (what save_model writes for a "
            "PEFT model) holds adapter_config.json and the adapter's weights."
        )


def check_warm_start(model_path: str, adapter: str) -> None:
    """An adapter trained on one ``embedded-agent`` (its base names the warm start's hash) is refused on another,
    naming both: the merged base's weights differ, and the adapter would load without a word."""
    import json

    from .embedded import trained_warm_start

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base = json.load(f).get("base_model_name_or_path") or ""
    trained, loaded = trained_warm_start(base), trained_warm_start(model_path)
    if trained is not None and loaded is not None and trained != loaded:
        raise ValueError(
            f"--adapter {adapter} was trained on embedded-agent with the warm start {trained}; --model loads the warm "
            f"start {loaded}, whose merged weights differ. Load it with the trl-mrtpo release that trained it."
        )


def load_policy(model: str, adapter: str | None = None, device_map: str | None = None):
    """``(model, tokenizer)``: ``model`` is a hub id, a folder or ``"embedded"``; ``adapter`` a LoRA adapter folder
    applied on top; ``device_map`` goes to ``from_pretrained`` (``"auto"`` places the model on the available
    accelerators)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import local_model

    check_policy_folders(model, adapter)
    model_path = local_model(model)
    if adapter:
        check_warm_start(model_path, adapter)
    # an adapter folder written by save_model holds the tokenizer too; one that does not falls back to the model's
    tokenizer_path = (
        adapter if adapter and os.path.isfile(os.path.join(adapter, "tokenizer_config.json")) else model_path
    )
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path, device_map=device_map)
    if adapter:
        from peft import PeftModel

        policy = PeftModel.from_pretrained(policy, adapter)
    return policy, tokenizer
