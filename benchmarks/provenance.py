"""What produced a result file: the commit, whether the tree had changes, and the library versions, written beside it
as ``<result>.provenance.json`` (a CSV stays a plain CSV)."""

from __future__ import annotations

import json
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

LIBRARIES = ("torch", "transformers", "trl", "peft", "trl-mrtpo")


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def provenance(command: str) -> dict:
    """The commit, a dirty flag, the versions of the libraries that set the numbers, the Python and the command."""
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {
        "commit": _git("rev-parse", "--short", "HEAD"),
        "uncommitted_changes": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "versions": versions,
        "python": platform.python_version(),
        "command": command,
    }


def write_provenance(result: str | Path, command: str) -> Path:
    """Write ``<result>.provenance.json`` and return its path."""
    path = Path(f"{result}.provenance.json")
    path.write_text(json.dumps(provenance(command), indent=2) + "\n")
    return path
