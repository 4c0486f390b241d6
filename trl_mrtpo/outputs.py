"""What the package's scripts may write over: their own files and folders, never a user's. A script checks its
outputs before it loads or trains anything, and a refusal names what is there."""

from __future__ import annotations

import os
import stat
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

# In the first bytes of every page the package writes, so that a later run knows the page as its own.
GENERATOR_META = '<meta name="generator" content="trl-mrtpo">'


class OutputRefused(ValueError):
    """An output path holds something the package did not write."""


def not_plain(path: Path) -> str | None:
    """What ``path`` is where a script would write, when that is not a plain file or folder (None otherwise, and when
    nothing is there): a script never writes through a link, nor opens a pipe or a device."""
    if path.is_symlink():
        return "a symbolic link"
    if not path.exists() or path.is_file() or path.is_dir():
        return None
    return "a named pipe" if stat.S_ISFIFO(path.stat().st_mode) else "neither a file nor a folder"


def writable_file(path: str | Path, overwrite: bool, ours: Callable[[Path], bool]) -> None:
    """``path`` may be written: it is absent, ``ours`` recognises it as this package's by its content, or
    ``overwrite`` is given; a link, a pipe or another special file there is refused whatever the flag."""
    path = Path(path)
    if (kind := not_plain(path)) is not None:
        raise OutputRefused(f"{path} is {kind}: trl-mrtpo writes only plain files of its own; choose another path.")
    if path.is_dir():
        raise OutputRefused(f"{path} is a folder; give a file path.")
    if path.exists() and not overwrite and not ours(path):
        raise OutputRefused(
            f"{path} exists and was not written by trl-mrtpo: choose another path, or pass --overwrite to replace it."
        )


def distinct_outputs(**outputs: str | None) -> None:
    """Refuses, before any work, two outputs of one command that name one file (``--output`` and ``--report``)."""
    named = {flag: Path(path).resolve() for flag, path in outputs.items() if path}
    for flag, path in named.items():
        others = [other for other, same in named.items() if other != flag and same == path]
        if others:
            raise OutputRefused(f"--{flag} and --{others[0]} name one file, {path}: give each output its own path.")


def write_output(path: str | Path, text: str) -> None:
    """``text`` into a new file beside ``path``, then renamed onto it in one step: never written through a link (a
    link is replaced, not followed), never left half-written."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        with open(temporary, "x", encoding="utf-8", newline="") as handle:  # a new file, with open()'s own mode
            handle.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def writable_folder(path: str | Path, overwrite: bool, own: Callable[[Path], bool]) -> None:
    """``path`` may be written into: it is absent or a folder whose every entry ``own`` recognises as this script's
    by its content, unless ``overwrite`` is given (the script then writes beside the other entries and removes
    none). A link in place of the folder is refused whatever the flag, and a link inside it is never the script's."""
    path = Path(path)
    if (kind := not_plain(path)) is not None:
        raise OutputRefused(f"{path} is {kind}: give a folder of your own.")
    if path.exists() and not path.is_dir():
        raise OutputRefused(f"{path} is a file; give a folder.")
    if overwrite or not path.is_dir():
        return
    foreign = sorted(entry.name for entry in path.iterdir() if entry.is_symlink() or not own(entry))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise OutputRefused(
            f"{path} holds {', '.join(foreign[:5])}{more}, which this script did not write: choose a new or empty "
            "folder, or pass --overwrite to write beside them (nothing of theirs is removed)."
        )


def page_is_ours(path: Path) -> bool:
    """An HTML page the package wrote (:data:`GENERATOR_META` near its start); read only once
    :func:`writable_file` found a plain file there."""
    with open(path, "rb") as handle:
        return GENERATOR_META.encode() in handle.read(1024)


def build_folder(target: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """``target``, built by ``build(folder)`` in a unique temporary folder beside it and renamed into place in one
    step: an interrupted build never looks finished, and processes building at once (``accelerate launch`` on a
    first use) never remove each other's work. The first rename wins; a later builder drops its own copy and uses
    the finished one. A folder already at ``target`` that is not ``complete`` is another's: refused, never removed."""
    import shutil

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f"{target.name}.partial-", dir=target.parent))
    try:
        build(partial)
        try:
            os.rename(partial, target)  # atomic; fails when another process's finished folder is already there
        except OSError:
            if not complete(target):
                raise OutputRefused(
                    f"{target} exists but is not a finished build; remove it to build it again."
                ) from None
    finally:
        if partial.exists():
            shutil.rmtree(partial)
    return target
