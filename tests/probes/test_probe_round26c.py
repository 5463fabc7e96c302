"""Round 26c of issue 48: round 25's named leftovers, one class a test group:
1. a fix line in hydra's grammar (`pass KEY='/x/a,b'`) pasted into a shell as printed did not
   work: the shell strips the quotes hydra needs. Every such fix now shows the argument in the
   shell's quotes too, and pasted into bash it hands the command the value meant.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from core.errors import MoepipeError
from experiments.common.overrides import _parsed
from experiments.common.path_values import comma_in_item, comma_in_path, literal_dollar
from experiments.run import misplaced_output

# --- 1. a fix line pasted into a shell as it stands ---


def _bash_words(shown: str) -> list[str]:
    """The arguments bash hands a command for `shown` pasted after it, as it stands."""
    r = subprocess.run(
        ["bash", "--norc", "-c", f"printf '%s\\0' {shown}"],
        capture_output=True,
        check=True,
    )
    return r.stdout.decode().split("\0")[:-1]


def _command_gets(shown: str) -> str:
    """The one argument a command gets for a fix `shown` pasted into a shell: shlex's parse and
    bash's, which agree."""
    words = shlex.split(shown)
    assert words == _bash_words(shown), shown
    assert len(words) == 1, (shown, words)
    return words[0]


def _fix(line: str, after: str) -> str:
    return line.rpartition(after)[2]


_PATH_KEYS = ["hydra.run.dir", "hydra.sweep.dir", "dir", "out", "checkpoint", "src"]
_COMMA_PATHS = ["/x/a,b", "/x/a b,c", "/x/it's,b", "/x/a'b\",c"]


@pytest.mark.parametrize("path", _COMMA_PATHS)
@pytest.mark.parametrize("key", _PATH_KEYS)
def test_a_comma_in_a_paths_fix_works_pasted_into_a_shell(key: str, path: str) -> None:
    """Class: a fix in hydra's grammar the shell strips. `pass dir='/x/a,b'`, pasted, handed
    the command `dir=/x/a,b`: hydra's sweep of two values again."""
    said = comma_in_path(key, path, sweeping=False)
    assert said is not None
    arg = _command_gets(_fix(str(said), "pass "))
    assert _parsed(arg).value() == path, said


_CHARS = ["=", "'", '"', "'\"", "[", "]", "{", "}", "<", ">", "~", "#", ";"]


@pytest.mark.parametrize("char", _CHARS)
@pytest.mark.parametrize("key", ["hydra.run.dir", "dir", "checkpoint"])
def test_a_character_hydra_takes_quoted_has_a_fix_that_works_pasted(key: str, char: str) -> None:
    """Class: a fix in hydra's grammar the shell strips (`dir='/x/a#b'` pasted is `dir=/x/a#b`,
    refused again by hydra)."""
    path = f"/x/a{char}b"
    with pytest.raises(MoepipeError) as info:
        _parsed(f"{key}={path}")
    arg = _command_gets(_fix(str(info.value), "must be quoted: "))
    assert _parsed(arg).value() == path, info.value


@pytest.mark.parametrize(
    ("value", "want"),
    [
        ("é", "é"),
        ("[law,é]", ["law", "é"]),
        ("a,é", None),  # a sweep: its values, each
        ("/r/a=b,c d", "/r/a=b,c d"),
        ("[/r/a=1,/r/b=2]", ["/r/a=1", "/r/b=2"]),
    ],
)
def test_a_quoted_values_fix_works_pasted_into_a_shell(value: str, want: object) -> None:
    """Class: a fix in hydra's grammar the shell strips (a value beyond ASCII, a sweep's run
    dir holding `=`)."""
    with pytest.raises(MoepipeError) as info:
        _parsed(f"dir={value}")
    arg = _command_gets(_fix(str(info.value), "must be quoted: "))
    parsed = _parsed(arg)
    if want is None:
        assert [getattr(v, "text", v) for v in parsed.value().list] == ["a", "é"], info.value
    else:
        assert parsed.value() == want, info.value


def test_a_literal_dollar_brace_fix_works_pasted_into_a_shell() -> None:
    """Class: a fix in hydra's grammar the shell strips (`dir='.../a\\${x}'`: bash keeps the
    backslash but strips the quotes; the value left is no quoted string of hydra's)."""
    added = literal_dollar("dir", "Interpolation key 'x' not found")
    arg = _command_gets(_fix(added, "quoted: ")[:-1])
    assert arg == 'dir=".../a\\${x}"', added
    assert _parsed(arg).value() == ".../a\\${x}"


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (["-m", "hydra.run.dir='/tmp/a b,c'"], "hydra.sweep.dir"),
        (["hydra.sweep.dir='/tmp/é,x'"], "hydra.run.dir"),
    ],
)
def test_a_misplaced_run_dirs_fix_works_pasted_into_a_shell(argv: list[str], key: str) -> None:
    """Class: a fix in hydra's grammar the shell strips (`pass hydra.sweep.dir='/tmp/a b,c'`
    pasted is two arguments, `hydra.sweep.dir=/tmp/a` and `b,c`)."""
    said = misplaced_output(argv)
    assert said is not None
    arg = _command_gets(_fix(said, "pass ").removesuffix(", or add -m"))
    assert arg.startswith(f"{key}=") and _parsed(arg).value() == argv[-1].split("=")[1][1:-1]


def test_a_comma_inside_a_list_items_fix_works_pasted(tmp_path: Path) -> None:
    """Class: a fix in hydra's grammar the shell strips (`pass runs=['/x/a,b']`, pasted, is
    `runs=[/x/a,b]`: the item split again)."""
    (tmp_path / "a,b").mkdir()
    items = [str(tmp_path / "a"), "b"]
    said = comma_in_item("runs", items)
    assert said is not None
    arg = _command_gets(_fix(str(said), "pass "))
    assert _parsed(arg).value() == [str(tmp_path / "a,b")], said
