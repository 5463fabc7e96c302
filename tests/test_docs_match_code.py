"""The docs name what the code has: docs/architecture.md's module map places every package,
module and conf/ group (and names nothing that is gone), each placed module says what it is in
a docstring, and docs/commands.md documents every option each command's schema takes. A new
module or option fails here naming what to add, rather than leaving the docs a session behind.
Read as text, without importing the modules: well under a second."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "sim", "real", "planners", "experiments")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _section(page: Path, heading: str) -> str:
    """The text of `page` under `heading` (a `## ` line), up to the next heading of that level."""
    text = page.read_text()
    m = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{page.relative_to(ROOT)} has no '{heading}' section"
    return m.group(1)


def _code_modules() -> set[str]:
    """Every module of the packages, and the tests' helper modules (not test_*.py, not an empty
    package marker), as paths from the repository root."""
    found = {p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    found |= {
        p
        for p in (ROOT / "tests").rglob("*.py")
        if not p.name.startswith("test_") and p.name != "__init__.py"
    }
    return {p.relative_to(ROOT).as_posix() for p in found if "__pycache__" not in p.parts}


def _conf_groups() -> set[str]:
    return {f"conf/{p.name}/" for p in (ROOT / "conf").iterdir() if p.is_dir()}


def _mapped() -> set[str]:
    """The paths the module map places: each entry's first inline code, `- `path`: ...`."""
    return set(re.findall(r"^- `([\w/.]+)`:", _section(ARCHITECTURE, "## Module map"), re.M))


def test_module_map_places_every_module() -> None:
    missing = sorted((_code_modules() | _conf_groups()) - _mapped())
    assert not missing, (
        "docs/architecture.md's Module map lacks (add `- `PATH`: one-line purpose`): "
        + ", ".join(missing)
    )


def test_module_map_names_nothing_gone() -> None:
    gone = sorted(p for p in _mapped() if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's Module map names what no longer exists: {gone}"


def _has_docstring(path: Path) -> bool:
    """Whether the module's first statement is a string (comment lines before it allowed)."""
    lines = [x for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return bool(lines) and re.match(r'[rbuRBU]?("""|\'\'\'|"|\')', lines[0]) is not None


def test_placed_modules_have_docstrings() -> None:
    bare = sorted(m for m in _code_modules() if not _has_docstring(ROOT / m))
    assert not bare, f"these modules say nothing of what they are (add a docstring): {bare}"
