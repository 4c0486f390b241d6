"""Chat templates, resolved in one place: what a recipe's ``chat_template_path`` names (a Jinja file, a template TRL
ships by name, or a tokenizer's), checked as ``apply_chat_template`` compiles it; and the name TRL ships a template
under, for a model card. ``train``, ``inspect``, the embedded models and the agent warm start resolve them here."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import trl

SHIPPED_FOLDER = os.path.join(os.path.dirname(trl.__file__), "chat_templates")  # TRL's own templates, by name
TEMPLATE_SUFFIXES = (".jinja", ".jinja2", ".j2")


def chat_template(path: str) -> str:
    """The Jinja text ``chat_template_path`` names: a template file (any name), a template TRL ships by name, or a
    tokenizer's (a folder or hub id). A file that is empty or does not parse is refused naming it and the option."""
    shipped = os.path.join(SHIPPED_FOLDER, f"{path}.jinja")
    for candidate in (path, *(() if os.sep in path else (shipped,))):
        if os.path.isfile(candidate):
            with open(candidate, encoding="utf-8") as handle:
                return checked_template(handle.read(), f"chat_template_path={path!r} ({candidate})")
    if not os.path.exists(path) and (os.path.isabs(path) or path.endswith(TEMPLATE_SUFFIXES)):
        raise ValueError(f"chat_template_path={path!r}: no such file.")
    try:
        template = _tokenizer_chat_template(path)
    except (OSError, ValueError) as error:
        names = sorted(name.removesuffix(".jinja") for name in os.listdir(SHIPPED_FOLDER) if name.endswith(".jinja"))
        raise ValueError(
            f"chat_template_path={path!r} is neither a template file, a template TRL ships ({', '.join(names)}) nor "
            "a tokenizer that loads."
        ) from error
    if not template:
        raise ValueError(f"chat_template_path={path!r}: the tokenizer there has no chat template.")
    return checked_template(template, f"chat_template_path={path!r}")


@functools.lru_cache(maxsize=8)
def _tokenizer_chat_template(name_or_path: str) -> str | None:
    """The chat template of a tokenizer folder or Hub id, loaded once per process (the recipe check and the trainer
    both ask for it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path).chat_template


def checked_template(text: str, where: str) -> str:
    """``text`` when it is a chat template that compiles as ``apply_chat_template`` compiles it; else a ValueError
    naming ``where``."""
    from jinja2 import TemplateSyntaxError

    from ._trl import compile_chat_template

    if not text.strip():
        raise ValueError(f"{where} is empty: a chat template is needed.")
    try:
        compile_chat_template(text)
    except TemplateSyntaxError as error:
        raise ValueError(
            f"{where} does not parse as a Jinja template (line {error.lineno}: {error.message})."
        ) from None
    return text


def shipped_template_name(template: str | None) -> str | None:
    """``trl/chat_templates/<name>.jinja``'s name when ``template`` is that file's text, else None."""
    for path in sorted(Path(SHIPPED_FOLDER).glob("*.jinja")) if template else ():
        if path.read_text(encoding="utf-8") == template:
            return f"TRL's `{path.stem}` (`chat_template_path: {path.stem}`)"
    return None
