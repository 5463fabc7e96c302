"""DESIGN.md's dependency direction: core and planners never import torch, simpy or hydra;
sim never imports real and vice versa; none of them imports experiments."""

import subprocess
import sys

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
