"""Round 24k of issue 48: what this session built, probed as an adversarial user. Classes:

1. a path holding a bracket, a brace or a parenthesis in a folder's name (`runs/a[1]`,
   `out/b(2)`), given to any command (`hydra.run.dir=`, report's `dir=`, `out=`), ended in
   hydra's own grammar line, "mismatched input '[' expecting <EOF>", which does not say that
   quoting it is the fix. Now the line names the character and the override quoted.
2. a run dir's path holding `=` and a comma whose piece after it is no `key=value`
   (`runs/a=b,c d`) was told to quote itself as two values (`"'runs/a=b','c d'"`), a sweep
   that one run cannot take: following the fix failed again. Now it is quoted whole.
"""

from __future__ import annotations

import pytest

from experiments.common.overrides import _parsed
from tests.probes.conftest import raises_one_line

# --- 1. a bracket, a brace or a parenthesis inside a path ---


@pytest.mark.parametrize("name", ["a[1]", "a]b", "a{b}", "b(2)", "x)y"])
@pytest.mark.parametrize("key", ["hydra.run.dir", "dir", "out"])
def test_a_path_holding_a_bracket_says_to_quote_it(key: str, name: str) -> None:
    path = f"/tmp/runs/{name}"
    line = raises_one_line(lambda: _parsed(f"{key}={path}"), f"must be quoted: {key}='{path}'")
    fix = line.rpartition("must be quoted: ")[2]
    assert _parsed(fix).value() == path  # the fix is one value: the path as typed


def test_a_list_or_a_bracket_left_open_keeps_hydras_line() -> None:
    assert _parsed("runs=[/a/b,/c/d]").value() == ["/a/b", "/c/d"]
    with pytest.raises(Exception, match="no viable alternative"):  # noqa: PT011 (hydra's)
        _parsed("runs=[/a/b,/c/d")


# --- 2. a run dir's path holding `=` and a comma ---


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        ("/r/a=b,c d", "'/r/a=b,c d'"),  # a comma in a folder's name: one path
        ("/r/p=8,w=tiny", "'/r/p=8,w=tiny'"),  # a sweep point's folder: one path
        ("[/r/a=1,/r/b=2]", "['/r/a=1','/r/b=2']"),  # a list: each item
    ],
)
def test_a_run_dir_holding_a_comma_is_quoted_as_the_value_it_is(value: str, fix: str) -> None:
    line = raises_one_line(lambda: _parsed(f"dir={value}"), f'must be quoted: dir="{fix}"')
    quoted = line.rpartition("must be quoted: dir=")[2][1:-1]
    want = [i.strip("'") for i in fix[1:-1].split("','")] if value[0] == "[" else value
    assert _parsed(f"dir={quoted}").value() == want
