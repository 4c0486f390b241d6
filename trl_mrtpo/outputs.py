"""What the package's scripts may write over: their own files and folders, never a user's. A script checks its
outputs before it loads or trains anything, and a refusal names what is there."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

# In the first bytes of every page the package writes, so that a later run knows the page as its own.
GENERATOR_META = '<meta name="generator" content="trl-mrtpo">'


class OutputRefused(ValueError):
    """An output path holds something the package did not write."""


def writable_file(path: str | Path, overwrite: bool, ours: Callable[[Path], bool]) -> None:
    """``path`` may be written: it is absent, ``ours`` recognises it as this package's, or ``overwrite`` is given."""
    path = Path(path)
    if path.is_dir():
        raise OutputRefused(f"{path} is a folder; give a file path.")
    if path.exists() and not overwrite and not ours(path):
        raise OutputRefused(
            f"{path} exists and was not written by trl-mrtpo: choose another path, or pass --overwrite to replace it."
        )


def writable_folder(path: str | Path, overwrite: bool, own: Callable[[str], bool]) -> None:
    """``path`` may be written into: it is absent or a folder whose every entry's name is one ``own`` recognises as
    this script's, unless ``overwrite`` is given (the script then writes beside the other entries and removes none)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputRefused(f"{path} is a file; give a folder.")
    if overwrite or not path.is_dir():
        return
    foreign = sorted(entry.name for entry in path.iterdir() if not own(entry.name))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise OutputRefused(
            f"{path} holds {', '.join(foreign[:5])}{more}, which this script did not write: choose a new or empty "
            "folder, or pass --overwrite to write beside them (nothing of theirs is removed)."
        )


def page_is_ours(path: Path) -> bool:
    """An HTML page the package wrote (:data:`GENERATOR_META` near its start)."""
    with open(path, "rb") as handle:
        return GENERATOR_META.encode() in handle.read(1024)


def build_folder(target: Path, build: Callable[[Path], None], complete: Callable[[Path], bool]) -> Path:
    """``target``, built by ``build(folder)`` in a unique temporary folder beside it and renamed into place in one
    step: an interrupted build never looks finished, and processes building at once (``accelerate launch`` on a
    first use) never remove each other's work. The first rename wins; a later builder drops its own copy and uses
    the finished one. A folder already at ``target`` that is not ``complete`` is another's: refused, never removed."""
    import os
    import shutil
    import tempfile

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
