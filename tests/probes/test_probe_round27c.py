"""Round 27c of issue 48: the lines and ranges left from rounds 26c and 26f, one class a group:
2. a newline (or a tab, any control character) inside an override (bash's $'...', a line
   break pasted into the command) gave a fix holding `\\n`, which pasted is the two characters
   \\ and n, not the newline. Such an override is one line saying what it holds, with a fix
   that pastes as one argument, which the command then takes.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import one_line

TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]
NOWHERE = "hydra.run.dir=/nonexistent/r27c"

# --- 2. a control character inside an override ---


def _bash_words(shown: str) -> list[str]:
    """The arguments bash hands a command for `shown` pasted after it, as it stands."""
    r = subprocess.run(
        ["bash", "--norc", "-c", f"printf '%s\\0' {shown}"], capture_output=True, check=True
    )
    return r.stdout.decode().split("\0")[:-1]


FIX = "pass it on one line: "


@pytest.mark.parametrize(
    ("module", "given", "sep", "rest"),
    [
        ("experiments.make_checkpoint", "out={tmp}/a b", "\n", ["model=tiny"]),
        ("experiments.make_checkpoint", "out={tmp}/a#b", "\n", ["model=tiny"]),
        ("experiments.make_checkpoint", "out={tmp}/it's", "\r\n", ["model=tiny"]),
        ("experiments.make_checkpoint", "out={tmp}/ab", "\t", ["model=tiny"]),
        ("experiments.run", "model.name=ab", "\n", [*TINY, "hydra.run.dir={tmp}/run"]),
        ("experiments.collect", "dir={tmp}/ab", "\x1b", []),
    ],
    ids=["newline", "newline-hash", "crlf-quote", "tab", "run-name", "escape"],
)
def test_a_control_character_in_an_override_has_a_fix_that_pastes(
    cli_here: Any, tmp_path: Path, module: str, given: str, sep: str, rest: list[str]
) -> None:
    """Class: a fix holding `\\n` (`"model.name='a\\nb'"`): pasted, the command got a
    backslash and an n. The line says what the value holds; its fix, through shlex and bash,
    is one argument without it, and the command takes that argument."""
    rest = [r.format(tmp=tmp_path) for r in rest]
    meant = given.format(tmp=tmp_path)
    key, _, value = meant.partition("=")
    cut = len(value) // 2 + 1
    typed = f"{key}={value[:cut]}{sep}{value[cut:]}"
    line = one_line(cli_here(module, *rest, typed), "which no option takes", FIX)
    shown = line.partition(FIX)[2]
    words = shlex.split(shown)
    assert words == _bash_words(shown) and len(words) == 1, line
    assert not any(ord(c) < 32 for c in line), line
    again = cli_here(module, *rest, words[0])
    assert "no option takes" not in again.stderr, again.stderr
    if module == "experiments.make_checkpoint":  # it wrote the checkpoint where it was meant
        assert again.returncode == 0, again.stderr
        assert (Path(value) / "config.json").is_file(), again.stderr
