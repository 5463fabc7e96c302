"""`core.lazy.lazy_module`: pandas imported where a frame is first used, not by a command's
imports (a command that stops at its config never reads one)."""

from __future__ import annotations

import subprocess
import sys

from core.lazy import lazy_module
from tests.probes.conftest import ROOT


def test_a_command_imports_no_pandas_until_it_reads_a_frame() -> None:
    """`experiments.run`'s imports took pandas (a quarter of a second) for every command, one
    that stops at a bad value too; a frame's first use still imports it."""
    code = (
        "import sys, experiments.run, core.trace, core.balance\n"
        "print('pandas' in sys.modules)\n"
        "frame = core.trace.pd.DataFrame({'a': [1]})\n"
        "print('pandas' in sys.modules, type(frame).__name__, core.balance.pd.DataFrame is "
        "type(frame))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "DataFrame", "True"]


def test_a_module_already_imported_is_itself() -> None:
    assert lazy_module("json") is __import__("json")


def test_a_stand_in_takes_the_modules_names_once_read() -> None:
    stand_in = lazy_module("colorsys")  # imported by nothing else here
    assert stand_in.rgb_to_hsv(1.0, 0.0, 0.0) == (0.0, 1.0, 1.0)
    assert "rgb_to_hsv" in vars(stand_in)  # later reads skip __getattr__
