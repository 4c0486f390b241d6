"""Adapters of a local copy of a Hub model (the embedded model's cached folder) name the Hub id in the files a save
writes, not the folder they were loaded from, so that whoever downloads an adapter can load it. The user's live
model keeps naming the folder (PEFT reads it at every save to learn whether the vocabulary changed)."""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .utils import local_copy


def local_copies(model: nn.Module) -> dict[str, str]:
    """``{local folder: Hub id}`` for every adapter of a PEFT model loaded from a local copy (empty otherwise)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        return {}
    copies = {}
    for config in model.peft_config.values():
        copy = local_copy(config.base_model_name_or_path)
        if copy is not None:
            copies[config.base_model_name_or_path] = copy[0]
    return copies


def write_hub_ids(copies: dict[str, str], folder: str | Path) -> None:
    """After a save into ``folder``: the written ``adapter_config.json`` files and PEFT's model card name the Hub id
    wherever they name a local copy."""
    folder = Path(folder)
    for path in [folder / "adapter_config.json", *folder.glob("*/adapter_config.json")]:
        if path.is_file():
            written = json.loads(path.read_text())
            if written.get("base_model_name_or_path") in copies:
                written["base_model_name_or_path"] = copies[written["base_model_name_or_path"]]
                path.write_text(json.dumps(written, indent=2, sort_keys=True))
    card = folder / "README.md"  # PEFT's card, written during the save, names the base it was given
    if card.is_file():
        text = card.read_text()
        for local, hub_id in copies.items():
            text = text.replace(f"base_model: {local}\n", f"base_model: {hub_id}\n")
        card.write_text(text)
