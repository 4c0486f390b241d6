"""The method readable on its own: the lines of the package's modules the trainer's module imports, transitively
(module level or inside functions, docstrings and comments counted), measured and held; the rooms built on the core
live in their own subpackages.

Run ``python tests/test_layout.py`` to print the modules and their lines.
"""

import ast
import importlib
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mrtpo"
# Measured (4,359) when the rules, terms, relevance provider and subpackages landed, 4,119 once the Triton kernel
# registered itself as a divergence backend, 4,303 with the check that nothing non-finite reaches the optimizer
# (finite_credit, +184); the aim is about 2,500. It rises only for a feature named here; lower it when the method's
# modules shrink.
METHOD_LINES_CEILING = 4303


def module_path(name: str) -> Path | None:
    relative = Path(*name.split(".")[1:])
    for path in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
        if name.startswith("trl_mrtpo") and path.is_file():
            return path
    return None


def imported_modules(name: str) -> set[str]:
    """The package's modules the import statements of module ``name`` name; a package's ``__init__`` counts when an
    import names the package itself (``from .ops import f``)."""
    path = module_path(name)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            submodules = [f"{module}.{alias.name}" for alias in node.names]
            # ``from . import x`` names the module x; ``from .x import y`` names x, and x.y when it is a module
            candidates = submodules if node.module is None else [module, *submodules]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found.update(c for c in candidates if c.startswith("trl_mrtpo") and module_path(c) is not None)
    return found


def method_modules() -> dict[str, int]:
    """Module -> lines, from ``trl_mrtpo.trainer`` through every import, transitively."""
    seen, pending = {}, ["trl_mrtpo.trainer"]
    while pending:
        name = pending.pop()
        if name not in seen:
            seen[name] = len(module_path(name).read_text().splitlines())
            pending.extend(imported_modules(name))
    return dict(sorted(seen.items()))


def test_the_method_is_read_in_its_own_modules():
    modules = method_modules()
    total = sum(modules.values())
    assert total <= METHOD_LINES_CEILING, f"{total} lines in {len(modules)} modules: {modules}"
    # nothing of the rooms built on the core
    rooms = ("steps", "observability", "baselines", "research", "gym", "kits", "scripts")
    assert not [name for name in modules if name.split(".")[1] in rooms]


MOVED = {
    "process_rewards": "steps.process_rewards",
    "step_labels": "steps.step_labels",
    "opsd": "baselines.opsd",
    "self_certainty": "baselines.self_certainty",
    "viz": "observability.viz",
    "callbacks": "observability.callbacks",
}


def test_the_rooms_have_their_own_subpackages():
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    for room in ("steps", "observability", "baselines", "research", "gym", "kits", "scripts", "ops"):
        assert (PACKAGE / room / "__init__.py").is_file(), room
    # at the top level, a moved module's old path is a shim and nothing more
    shims = [name for name in top if "alias(__name__" in (PACKAGE / f"{name}.py").read_text()]
    assert set(shims) == set(MOVED)


def test_an_old_module_path_warns_and_is_the_moved_module():
    for old, new in MOVED.items():
        sys.modules.pop(f"trl_mrtpo.{old}", None)
        with pytest.warns(FutureWarning, match=f"`trl_mrtpo.{old}` moved to `trl_mrtpo.{new}`"):
            module = importlib.import_module(f"trl_mrtpo.{old}")
        assert module is importlib.import_module(f"trl_mrtpo.{new}")


if __name__ == "__main__":
    modules = method_modules()
    for name, lines in modules.items():
        print(f"{lines:5d} {name}")
    print(f"{sum(modules.values())} lines in {len(modules)} modules")


def test_names_moved_out_of_a_module_warn_and_resolve():
    import trl_mrtpo.credit
    from trl_mrtpo.steps import credit

    for name in ("process_advantages", "failure_suffix_mask"):
        with pytest.warns(FutureWarning, match=f"`trl_mrtpo.credit.{name}` moved to `trl_mrtpo.steps.credit.{name}`"):
            assert getattr(trl_mrtpo.credit, name) is getattr(credit, name)
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        assert trl_mrtpo.credit.nothing is None  # raises first
    from trl_mrtpo.ops import divergence, triton_divergence

    moved = "`trl_mrtpo.ops.divergence.validate_triton_kernel` moved to `trl_mrtpo.ops.triton_divergence"
    with pytest.warns(FutureWarning, match=moved):
        assert divergence.validate_triton_kernel is triton_divergence.validate_triton_kernel
