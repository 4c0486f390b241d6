"""The layout: the rooms built on the core live in their own subpackages, the top level holds the core's modules only,
and a room never imports an application upward (what the default run loads is measured in
``tests/test_default_load.py``)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trl_mrtpo"
ROOMS = ("checks", "steps", "observability", "baselines", "research", "gym", "kits", "scripts", "ops")
CORE = {
    "__init__", "_trl", "batch", "chat_templates", "config", "constants", "credit", "diagnostics", "hub_ids",
    "info_blocks", "model_card", "outputs", "relevance", "replay", "rules", "sequence_states", "state", "strength",
    "trainer", "trajectories", "utils",
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


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Module -> the package's modules its import statements name (``from . import x`` names ``x``, not the
    package that holds it)."""
    modules = {".".join(f.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): f
               for f in package.rglob("*.py")}  # fmt: skip
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                stem = ".".join(
                    [*(base[: len(base) - node.level + 1] if node.level else []), *filter(None, [node.module])]
                )
                named = [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in modules]
                imported.update(named or [stem])
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each set of modules that import one another, through any path."""
    reach = {m: set() for m in graph}
    for start in graph:
        pending = list(graph[start])
        while pending:
            module = pending.pop()
            if module not in reach[start]:
                reach[start].add(module)
                pending.extend(graph[module])
    found = {frozenset({m, *(o for o in reach[m] if m in reach[o])}) for m in graph if m in reach[m]}
    return sorted(sorted(c) for c in found)


def test_the_package_has_no_import_circle():
    """Imported at the top or inside a function, no module of the package reaches itself again (the device rule and
    the divergence module did, and the embedded models and the train command through the chat-template resolver)."""
    assert circles(import_graph()) == []
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(planted) == [["a", "b", "c"]]
