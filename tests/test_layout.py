"""The layout: the rooms built on the core live in their own subpackages, the top level holds the core's modules only,
and a room never imports an application upward (what the default run loads is measured in
``tests/test_default_load.py``)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mrtpo"
ROOMS = ("checks", "steps", "observability", "baselines", "research", "gym", "kits", "scripts", "ops")
CORE = {
    "__init__", "_trl", "batch", "config", "constants", "credit", "credit_state", "diagnostics", "hub_ids",
    "info_blocks", "model_card", "outputs", "relevance", "replay", "rules", "strength", "trainer", "trajectories",
    "utils",
}  # fmt: skip


def imported_names(path: Path) -> set[str]:
    """The absolute module names (as far as the trl_mrtpo package goes) a file's import statements name."""
    package = ["trl_mrtpo", *path.relative_to(PACKAGE).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            names.add(".".join([*base, *([node.module] if node.module else [])]))
            names.update(".".join([*base, *([node.module] if node.module else []), a.name]) for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_rooms_have_their_own_subpackages():
    for room in ROOMS:
        assert (PACKAGE / room / "__init__.py").is_file(), room
    assert {path.stem for path in PACKAGE.glob("*.py")} == CORE


def test_no_room_imports_an_application():
    """The applications (``scripts``: the command, the demo, inspect, eval) import the rooms, never the reverse."""
    upward = {
        str(path.relative_to(PACKAGE)): sorted(n for n in imported_names(path) if n.startswith("trl_mrtpo.scripts"))
        for room in ROOMS
        if room != "scripts"
        for path in (PACKAGE / room).rglob("*.py")
    }
    assert not {path: names for path, names in upward.items() if names}
