"""docs/configuration.md is generated from the docstrings of MRTPOConfig and ResearchConfig (every field, its default
and help), so it cannot drift: this test fails when they differ. Regenerate with ``python tests/test_docs.py``."""

import dataclasses
import re
from pathlib import Path

from trl import GRPOConfig

from trl_mrtpo import MRTPOConfig
from trl_mrtpo.config import RENAMED_CHECKPOINTING
from trl_mrtpo.research import ResearchConfig

# transformers' own field, which MRTPOConfig carries itself on a transformers that predates it (5.17: vLLM's stack)
TRANSFORMERS_FIELDS = set() if RENAMED_CHECKPOINTING else {"activation_checkpointing"}

PAGE = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
HEADER = """# Configuration

`MRTPOConfig` takes every field of TRL's `GRPOConfig` and the fields below (generated from its docstring by
`python tests/test_docs.py`; a test keeps the two equal). `GRPOConfig`'s `beta` stays the KL coefficient; MRTPO's
redistribution strength is `credit_beta`. Command-line flags have the same names (`--credit_beta 0.5`).
"""
RESEARCH_HEADER = """
# The research room: `ResearchConfig`

`trl_mrtpo.research.ResearchConfig` (for `ResearchTrainer`; `trainer: research` in a recipe) takes every field
above and these: the sibling methods, the ablations and the calibrated-credit options, each off by default, with
their evidence in `benchmarks/`. `MRTPOTrainer` refuses them rather than ignore them.
"""


def documented_fields(config=MRTPOConfig) -> list[tuple[str, str | None, str, str]]:
    """``(section, name, default, help)`` per field of the docstring's "Parameters:" list, in order."""
    text = config.__doc__.split("Parameters:", 1)[1]
    entries, section = [], None
    for block in re.split(r"\n(?=        \S)", text):
        block = block.strip("\n")
        if block.strip().startswith(">"):
            section = block.strip().lstrip("> ").strip()
            if "\n" in section:  # a section line followed by the first field in the same block
                section, block = section.split("\n", 1)
            else:
                continue
        match = re.match(r"\s*(\w+) \(`(.+?)`(?:, \*optional\*)?(?:, defaults to `(.*?)`)?\):\s*\n(.*)", block, re.S)
        if match:
            name, _, default, body = match.groups()
            entries.append((section, name, default, " ".join(body.split())))
    return entries


def render() -> str:
    lines = []
    for header, config in ((HEADER, MRTPOConfig), (RESEARCH_HEADER, ResearchConfig)):
        lines.append(header)
        current = None
        for section, name, default, help_text in documented_fields(config):
            if section != current:
                current = section
                title = f"## {section[0].upper()}{section[1:]}"
                lines += ["", title, "", "| field | default | meaning |", "|---|---|---|"]
            escaped = help_text.replace("|", "\\|")
            lines.append(f"| `{name}` | `{default}` | {escaped} |")
    return "\n".join(lines) + "\n"


def test_every_field_is_documented_once():
    for config, parent in ((MRTPOConfig, GRPOConfig), (ResearchConfig, MRTPOConfig)):
        own = [
            f.name
            for f in dataclasses.fields(config)
            if f.name not in {*parent.__dataclass_fields__, *TRANSFORMERS_FIELDS}
        ]
        names = [name for _, name, _, _ in documented_fields(config)]
        if config is ResearchConfig:
            own.append("credit_assignment")  # redefined with the research room's modes
        assert sorted(names) == sorted(own), f"{config.__name__}'s docstring and its fields differ"
        for _, name, default, _ in documented_fields(config):
            value = config.__dataclass_fields__[name].default
            assert default == (repr(value) if isinstance(value, str) else str(value)).replace("'", '"'), name


def test_the_core_configuration_stays_small():
    """MRTPOConfig adds at most 12 fields to GRPOConfig; what did not earn a place is in the research room."""
    own = [
        f.name
        for f in dataclasses.fields(MRTPOConfig)
        if f.name not in {*GRPOConfig.__dataclass_fields__, *TRANSFORMERS_FIELDS}
    ]
    assert len(own) <= 12, own


def test_configuration_page_is_generated_from_the_docstring():
    assert PAGE.read_text() == render(), "docs/configuration.md is stale: run python tests/test_docs.py"


if __name__ == "__main__":
    PAGE.write_text(render())


def test_relative_links_resolve():
    """Every relative link of README.md, docs/ and benchmarks/ points to a file that exists."""
    root = PAGE.parents[1]
    pages = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "benchmarks").glob("*.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if not target.startswith(("http://", "https://", "mailto:")) and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(root)} -> {target}")
    assert not broken, broken


def test_every_extension_surface_names_a_test_that_exists():
    """docs/architecture.md's table of public extension surfaces: each row names a test that exists."""
    import ast

    root = PAGE.parents[1]
    text = (root / "docs" / "architecture.md").read_text()
    section = text.split("## Public extension surfaces", 1)[1].split("\n## ", 1)[0]
    named = re.findall(r"`(test_\w+\.py)::(test_\w+)`", section)
    assert len(named) >= 8
    for file, name in named:
        tree = ast.parse((root / "tests" / file).read_text())
        assert name in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, (file, name)


def test_the_kits_page_names_the_demos_default_task():
    from trl_mrtpo.scripts import DEMO_SETTINGS

    text = (Path(__file__).resolve().parents[1] / "docs" / "kits.md").read_text()
    assert f"(`--task {DEMO_SETTINGS['task']}`, the default," in text
