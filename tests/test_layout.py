"""The method readable on its own: the lines of the package's modules the trainer's module imports, transitively
(module level or inside functions, docstrings and comments counted), measured and held; the rooms built on the core
live in their own subpackages.

Run ``python tests/test_layout.py`` to print the modules and their lines.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mrtpo"
# Measured when the rules, terms and relevance provider landed (docs/architecture.md); the aim is about 2,500. It
# may only fall: lower it when the method's modules shrink.
METHOD_LINES_CEILING = 4200


def module_path(name: str) -> Path | None:
    relative = Path(*name.split(".")[1:])
    for path in (PACKAGE / relative.with_suffix(".py"), PACKAGE / relative / "__init__.py"):
        if name.startswith("trl_mrtpo") and path.is_file():
            return path
    return None


def imported_modules(name: str) -> set[str]:
    """The package's modules an import statement of module ``name`` names: ``from .x import y`` names ``x`` (and
    ``x.y`` when that is a module); a package's ``__init__`` counts when an import names the package itself."""
    path = module_path(name)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            candidates = [module, *(f"{module}.{alias.name}" for alias in node.names)]
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


def test_the_rooms_have_their_own_subpackages():
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    for room in ("steps", "observability", "baselines", "research", "gym", "kits", "scripts", "ops"):
        assert (PACKAGE / room / "__init__.py").is_file(), room
    moved = {"process_rewards", "step_labels", "opsd", "self_certainty", "diagnostics", "viz", "callbacks"}
    # the old paths are shims that warn (tests/test_trl_seam.py); nothing else of a room is at the top level
    shims = [name for name in top if "alias(__name__" in (PACKAGE / f"{name}.py").read_text()]
    assert set(shims) == moved


if __name__ == "__main__":
    modules = method_modules()
    for name, lines in modules.items():
        print(f"{lines:5d} {name}")
    print(f"{sum(modules.values())} lines in {len(modules)} modules")
