"""Round 24c of issue 48: moepipe probed as a researcher who extends it from the docs (a new
planner, model, hardware, workload and experiment YAML, a user config dir, sweeps over them,
and the docs' own commands). Classes found:

- a planner file that does not import (a name already registered, a built-in's among them; a
  syntax error; a missing import; params that are not a dataclass) ended every command, even
  `--help`, in a traceback: `import planners` runs at a command's import, before its one error
  path. Now the file is kept as one line naming it, raised at the registry's first use;
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from planners import registry
from tests.probes.conftest import raises_one_line

HEAD = "from dataclasses import dataclass\nfrom planners.registry import register\n"
PLANNER = HEAD + (
    "@dataclass(frozen=True)\nclass P:\n    pass\n"
    "@register({name!r}, {params})\nclass C:\n    pass\n"
)
BROKEN_FILES = {
    "taken_builtin": (
        PLANNER.format(name="flexgen", params="P"),
        "is taken by planners/flexgen.py",
    ),
    "taken_twice": (PLANNER.format(name="sequential", params="P"), "is taken by"),
    "syntax": ("def broken(:\n", "line 1: invalid syntax (SyntaxError)"),
    "missing_import": ("import nosuch_module_24c\n", "No module named 'nosuch_module_24c'"),
    "params_not_dataclass": (PLANNER.format(name="x24c", params="dict"), "frozen dataclass"),
}


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry as it is, restored after the test (which adds to it)."""
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_BROKEN", [], raising=False)


@pytest.mark.parametrize("case", sorted(BROKEN_FILES))
def test_a_planner_file_that_does_not_import_is_one_line_naming_it(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_registry: None
) -> None:
    """A researcher's file in the planners package (here a package of its own, `planners24c`):
    its import is kept, and the registry's first use (every command's, in its error path)
    names the file and the fix in one line."""
    text, said = BROKEN_FILES[case]
    package = tmp_path / "planners24c"
    package.mkdir()
    (package / f"mine_{case}.py").write_text(textwrap.dedent(text))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry.import_planners([str(package)], "planners24c")  # no traceback at import
    line = raises_one_line(lambda: registry.entry("flexgen"), f"planners24c/mine_{case}.py", said)
    assert "fix" in line or "give @register" in line or "@dataclass" in line
    assert "flexgen" in registry.registered()  # what a command's import stores still works
    for name in [m for m in sys.modules if m.startswith("planners24c")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_same_planner_file_read_again_registers_again(own_registry: None) -> None:
    """importlib.reload of a planner's own file (a notebook's edit) is no clash with itself."""
    entry = registry.entry("sequential")
    registry.register("sequential", entry.params)(entry.factory)
    assert registry.entry("sequential").factory is entry.factory
