"""Adapters of a local copy of a Hub model (the embedded model's cached folder) name the Hub id, not the folder they
were loaded from, so that whoever downloads an adapter can load it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch import nn

from .utils import local_copy_hub_id

# (an adapter's config, the local folder it was loaded from, the Hub id that folder is a copy of)
LocalCopy = tuple[object, str, str]


def name_hub_ids(model: nn.Module) -> list[LocalCopy]:
    """Points every adapter config of a PEFT model loaded from a local copy at the Hub id, and returns what it
    changed (empty for any other model)."""
    from peft import PeftModel

    changed = []
    if isinstance(model, PeftModel):
        for config in model.peft_config.values():
            hub_id = local_copy_hub_id(config.base_model_name_or_path)
            if hub_id is not None:
                changed.append((config, config.base_model_name_or_path, hub_id))
                config.base_model_name_or_path = hub_id
    return changed


@contextmanager
def saving_with_hub_ids(copies: list[LocalCopy], folder: str | Path) -> Iterator[None]:
    """Around a save: the configs name the local folder, which PEFT can read (it looks a base up at every save to
    learn whether the vocabulary changed; a Hub id would warn twice on a machine without access); afterwards they
    name the Hub id again, and so do the written ``adapter_config.json`` files and PEFT's model card."""
    for config, local, _ in copies:
        config.base_model_name_or_path = local
    try:
        yield
    finally:
        for config, _, hub_id in copies:
            config.base_model_name_or_path = hub_id
    folder = Path(folder)
    hub_ids = {local: hub_id for _, local, hub_id in copies}
    for path in [folder / "adapter_config.json", *folder.glob("*/adapter_config.json")]:
        if path.is_file():
            written = json.loads(path.read_text())
            if written.get("base_model_name_or_path") in hub_ids:
                written["base_model_name_or_path"] = hub_ids[written["base_model_name_or_path"]]
                path.write_text(json.dumps(written, indent=2, sort_keys=True))
    card = folder / "README.md"  # PEFT's card, written during the save, names the base it was given
    if card.is_file():
        text = card.read_text()
        for local, hub_id in hub_ids.items():
            text = text.replace(f"base_model: {local}\n", f"base_model: {hub_id}\n")
        card.write_text(text)
