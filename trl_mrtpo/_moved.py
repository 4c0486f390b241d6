"""Old import paths of what moved (modules into subpackages, names into other modules): each still imports, with a
FutureWarning naming the new path, until 0.3."""

import importlib
import sys
import warnings
from collections.abc import Callable


def alias(old: str, new: str) -> None:
    """Makes module ``old`` the module ``new`` (called by the old path's module as it is imported)."""
    warnings.warn(
        f"`{old}` moved to `{new}` and is removed in 0.3; import it from there.", FutureWarning, stacklevel=3
    )
    sys.modules[old] = importlib.import_module(new)


def moved_attributes(module: str, moved: dict[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for names that moved out of ``module``: ``moved`` maps each name to its new module."""

    def attribute(name: str) -> object:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"`{module}.{name}` moved to `{moved[name]}.{name}` and leaves `{module}` in 0.3; import it from there.",
            FutureWarning,
            stacklevel=2,
        )
        return getattr(importlib.import_module(moved[name]), name)

    return attribute
