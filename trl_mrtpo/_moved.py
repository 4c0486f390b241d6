"""Old import paths of the modules that moved into subpackages: each still imports, with a FutureWarning, until
0.3."""

import importlib
import sys
import warnings


def alias(old: str, new: str) -> None:
    """Makes module ``old`` the module ``new`` (called by the old path's module as it is imported)."""
    warnings.warn(
        f"`{old}` moved to `{new}` and is removed in 0.3; import it from there.", FutureWarning, stacklevel=3
    )
    sys.modules[old] = importlib.import_module(new)
