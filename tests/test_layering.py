"""DESIGN.md's dependency direction: core and planners never import torch, simpy or hydra;
sim never imports real and vice versa; none of them imports experiments. No module of
experiments/ imports a command module."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    "package, forbidden",
    [
        ("core", ["torch", "simpy", "hydra", "experiments"]),
        ("planners", ["torch", "simpy", "hydra", "sim", "real", "experiments"]),
        ("sim", ["torch", "hydra", "real", "experiments"]),
        ("real", ["simpy", "hydra", "sim", "planners", "experiments"]),
    ],
)
def test_imports_stay_in_their_layer(package, forbidden):
    code = (
        "import sys, importlib, pkgutil\n"
        f"m = importlib.import_module('{package}')\n"
        "if hasattr(m, '__path__'):\n"
        "    for i in pkgutil.iter_modules(m.__path__):\n"
        f"        importlib.import_module('{package}.' + i.name)\n"
        f"bad = [f for f in {forbidden!r} if f in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{package} imported {out.stdout.strip()}"


def _commands() -> set[str]:
    """The command modules: every module directly in experiments/ and in experiments/bench/."""
    root = Path(__file__).resolve().parents[1] / "experiments"
    return {
        f"experiments.{sub}{p.stem}"
        for sub, folder in (("", root), ("bench.", root / "bench"))
        for p in folder.glob("*.py")
        if p.stem != "__init__"
    }


def _imported(path: Path) -> set[str]:
    """Every module `path` imports (at the top or inside a function), by its dotted name;
    `from experiments import x` and `from experiments.bench import x` name `experiments.x`."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("folder", ["experiments", "experiments/common", "experiments/bench"])
def test_no_module_imports_a_command(folder):
    """A command is an entry point: what two of them share lives in experiments/common/ (or
    core/, real/), so no module of experiments/, experiments/common/ or experiments/bench/
    imports a command module (checked by AST, imports inside functions too)."""
    root = Path(__file__).resolve().parents[1]
    commands = _commands()
    bad = []
    for path in sorted((root / folder).glob("*.py")):
        me = ".".join(path.relative_to(root).with_suffix("").parts)
        for name in sorted(_imported(path) & commands):
            if name != me:
                bad.append(f"{me} imports {name}")
    assert not bad, "; ".join(bad)
