"""Loading a policy to evaluate or inspect: a hub id, a local folder or the embedded model, plus a LoRA adapter."""

from __future__ import annotations


def load_policy(model: str, adapter: str | None = None, device_map: str | None = None):
    """``(model, tokenizer)``: ``model`` is a hub id, a folder or ``"embedded"``; ``adapter`` a LoRA adapter folder
    applied on top; ``device_map`` goes to ``from_pretrained`` (``"auto"`` places the model on the available
    accelerators)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .embedded import embedded_model_path

    model_path = embedded_model_path() if model == "embedded" else model
    tokenizer = AutoTokenizer.from_pretrained(adapter or model_path)
    policy = AutoModelForCausalLM.from_pretrained(model_path, device_map=device_map)
    if adapter:
        from peft import PeftModel

        policy = PeftModel.from_pretrained(policy, adapter)
    return policy, tokenizer
