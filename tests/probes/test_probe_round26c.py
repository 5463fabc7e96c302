"""Round 26c of issue 48: round 25's named leftovers, one class a test group:
1. a fix line in hydra's grammar (`pass KEY='/x/a,b'`) pasted into a shell as printed did not
   work: the shell strips the quotes hydra needs. Every such fix now shows the argument in the
   shell's quotes too, and pasted into bash it hands the command the value meant.
2. an int-typed field given a float, a number past any range or a word (`disk_mb=1e300`,
   `workload.batch_size=2.5`) was refused by omegaconf's typing, "must be an integer", before
   the project's check that names the range; a size below its range named only its lowest.
   Every int-typed field of every command now says its field and its working range.
3. a comma inside an item of a list of names (replication's `variants`, report's `columns`,
   any list option checked against its valid names) was named only as an unknown name, and a
   label holding `=` was told to pass its items joined as one run dir. The line now says the
   comma split an item and how to quote it; each item of a name list is quoted alone.
4. validate kept a refused planner's warnings until another planner's plan was accepted, and
   said them then, as that planner's. A refused planner's warnings go with its refusal.
   calibrate and reproduce_klotski, which accept no plan, said theirs only as they ended
   (minutes of measuring or simulating later); they say them once their inputs are accepted.
5. the forkserver that distributed ranks fork from (`python -c`) started with SIGTERM open, as
   torchrun's ranks did before round 25f: one in its start-up was the server's death, not the
   command's stop line. It starts, and stays, with it blocked; each rank unblocks it once set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import re
import shlex
import subprocess
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ValidationError

from core.args import as_size_mb
from core.errors import MoepipeError
from experiments.common import hydra_errors
from experiments.common.overrides import _parsed
from experiments.common.path_values import comma_in_item, comma_in_path, literal_dollar
from experiments.run import misplaced_output
from tests.probes.conftest import one_line, raises_one_line

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


# --- 2. an int-typed field's value of the wrong type names its range ---

_COMMANDS = [
    *("calibrate", "collect", "convert_traces", "make_checkpoint", "prefetch_eval"),
    *("replication", "replication_cv", "report", "reproduce_klotski", "routing_stats"),
    *("run", "trace_json", "validate", "validate_lanes", "torchrun"),
    *("bench.sim", "bench.real", "bench.host", "bench.lanes", "bench.accelerate"),
]
# what a line says of an int field's working range (core.errors.integer_words, or both ends)
_RANGE = re.compile(
    r"must be (an integer in \[-?\d+, \d+\]|a positive integer|a non-negative integer"
    r"|an integer >= -?\d+)"
)


def _int_fields() -> list[tuple[type, str]]:
    """Every int-typed field of every command's schema, its groups' and the planners' params."""
    for name in _COMMANDS:
        importlib.import_module(f"experiments.{name}")
    found = []
    for cls in hydra_errors._schema_classes():
        if cls.__module__.startswith("hydra."):  # hydra's own (hydra.job.num)
            continue
        hints = typing.get_type_hints(cls)
        found += [
            (cls, f.name)
            for f in dataclasses.fields(cls)
            if hints[f.name] in (int, typing.Optional[int])  # noqa: UP045 (as hints have it)
        ]
    return found


@pytest.mark.parametrize("value", [2.5, 1e300, "abc", "16MB", -1.5])
def test_every_int_fields_wrong_type_names_its_range(value: Any) -> None:
    """Class: a value omegaconf's typing refuses before the project's own check. Each of the
    commands' int-typed fields (over 100) said "must be an integer; pass KEY=<an integer>"."""
    fields = _int_fields()
    assert len(fields) > 100
    bare = []
    for cls, name in fields:
        cfg = OmegaConf.structured(cls)
        with pytest.raises(ValidationError) as info:
            setattr(cfg, name, value)
        line = hydra_errors.one_line(info.value)
        if line is None or f"{name}=" not in line or not _RANGE.search(line):
            bare.append((cls.__name__, name, line))
    assert not bare, bare


@pytest.mark.parametrize(
    ("module", "args", "said"),
    [
        ("experiments.calibrate", ["disk_mb=1e300"], "disk_mb=1e300: must be an integer in [1, "),
        ("experiments.calibrate", ["disk_mb=2.5"], "disk_mb=2.5: must be an integer in [1, "),
        ("experiments.calibrate", ["disk_mb=-5"], "disk_mb=-5: must be an integer in [1, "),
        (
            "experiments.run",
            # a run's workload has no highest of its own (int_ranges, round26c_gaps' table test)
            ["model=tiny", "hardware=tiny", "workload=tiny", "workload.batch_size=2.5"],
            "workload.batch_size=2.5: must be a positive integer",
        ),
        (
            "experiments.bench.real",
            ["model=tiny", "budget_gb=4", "slack_mb=-5"],
            "slack_mb=-5: must be an integer in [0, 1048576]",
        ),
    ],
)
def test_a_commands_int_option_names_its_range(
    cli_here: Any, module: str, args: list[str], said: str
) -> None:
    """Class: a value omegaconf's typing refuses before the project's own check (`disk_mb=1e300`
    was "must be an integer"), and a size below its range named only its lowest."""
    one_line(cli_here(module, *args, "hydra.run.dir=/nonexistent/r26c"), said)


@pytest.mark.parametrize("low", [0, 1])
def test_a_size_below_its_range_names_the_whole_range(low: int) -> None:
    """Class: a size below its range (`slack_mb=-5`) said "must be a non-negative integer",
    not the range that works."""
    raises_one_line(lambda: as_size_mb("x_mb", -5, at_least=low), f"in [{low}, 1048576]")


# --- 3. a comma inside an item of a list of names ---

_VARIANT = "predictive_replication[layer_corr,gate=none]"


@pytest.mark.parametrize(
    ("key", "items", "valid", "want"),
    [
        ("variants", ["predictive_replication[layer_corr", "gate=none]"], [_VARIANT], [_VARIANT]),
        ("only", ["fig14", "a", "b"], ["fig14", "a,b"], ["fig14", "a,b"]),
        ("planners", ["x", "y", "klotski"], ["x,y", "klotski"], ["x,y", "klotski"]),
        ("columns", ["planner.name", "a", "b"], ["planner.name", "a,b"], ["planner.name", "a,b"]),
        ("columns", ["x", "y"], ["x,z", "y"], None),  # no run of neighbours is a name
        ("train", ["law", "x", "y", "z"], ["law", "x,y,z"], ["law", "x,y,z"]),
    ],
)
def test_a_comma_inside_a_names_item_says_the_comma_split_it(
    key: str, items: list[str], valid: list[str], want: list[str] | None
) -> None:
    """Class: a list item split at its comma, named only as unknown names (`unknown
    predictive_replication[layer_corr, gate=none]`), for every list option of names
    (checked_names: replication, reproduce_klotski, validate, validate_lanes)."""
    from experiments.common.cli import checked_names

    if want is None:  # the unknown names' line, as before
        line = raises_one_line(lambda: checked_names(key, items, valid), "unknown x;")
        assert "splits" not in line
        return
    line = raises_one_line(lambda: checked_names(key, items, valid), "is one item, which hydra")
    arg = _command_gets(_fix(line, "pass "))
    assert _parsed(arg).value() == want, line


def test_a_report_column_split_at_its_comma_says_so() -> None:
    """Class: a list item split at its comma (report's `columns=[a,b]` where `a,b` is a column)."""
    import pandas as pd

    from experiments.common.ranking import REQUIRED, ReportError, check_request

    df = pd.DataFrame({**{k: [1.0] for k in REQUIRED}, "a,b": [1.0]})
    with pytest.raises(ReportError) as info:
        check_request(df, REQUIRED[0], ["a", "b"])
    line = str(info.value)
    assert "a,b is one item" in line, line
    assert _parsed(_command_gets(_fix(line, "pass "))).value() == ["a,b"]


@pytest.mark.parametrize(
    "value",
    [
        f"[eplb[interval=8],{_VARIANT}]",
        f"[{_VARIANT},oracle_replication[truth=0.5]]",
        _VARIANT,
    ],
)
def test_a_name_list_holding_equals_is_quoted_item_by_item(value: str) -> None:
    """Class: a list item split at its comma (`variants=[eplb[interval=8],...]` was told to
    pass both labels joined as one quoted item: a sweep's run dir's rule, for names)."""
    with pytest.raises(MoepipeError) as info:
        _parsed(f"variants={value}")
    line = str(info.value)
    assert "run dir" not in line, line
    got = _parsed(_command_gets(_fix(line, "must be quoted: "))).value()
    want = value[1:-1] if value.startswith("[") else value
    assert (got if isinstance(got, str) else ",".join(got)) == want, line


def test_replications_split_variant_is_one_line_saying_so(cli_here: Any) -> None:
    """Class: a list item split at its comma, through the command."""
    one_line(
        cli_here("experiments.replication", f"variants=['{_VARIANT[:-11]}','{_VARIANT[-10:]}']"),
        f"{_VARIANT} is one item, which hydra splits at its comma",
    )


# --- 4. a refused planner's warnings never reach another planner ---


@dataclasses.dataclass(frozen=True)
class _Spec:
    executor: str = "sim"
    model: Any = None
    workload: Any = None


def _validate_setup() -> Any:
    from experiments.validate import Setup

    return Setup("ck", ["a", "b"], None, None, None, Path("o"), (1, 1), 1, False, False, {}, {})


def _warns_then(name: str, refuse: bool) -> None:
    import logging

    from core.errors import CapacityError

    logging.getLogger("moepipe.probe").warning("%s-warned", name)
    if refuse:
        raise CapacityError(f"planner {name}: its working set does not fit")


def test_a_refused_planners_warnings_stay_with_its_refusal_in_real_runs(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Class: a refused run's warnings said as another's. validate's planner `a`, refused by
    the executor (a skipped row), had its warning said at planner `b`'s accepted plan."""
    from experiments import validate
    from experiments.common.held_warnings import warnings_held

    def execute(ckpt: str, spec: Any, mode: str, *, planner: str, **kw: Any) -> Any:
        _warns_then(planner, refuse=planner == "a")
        kw["on_planned"]()
        return "result", None

    monkeypatch.setattr(validate, "real_execute", execute)
    sims: dict[str, Any] = {n: (_Spec(), None, None, n) for n in ("a", "b")}
    rows: list[dict[str, Any]] = []
    with warnings_held():
        reals, _ = validate._real_runs(_validate_setup(), sims, rows)
    said = [r.getMessage() for r in caplog.records]
    assert "a-warned" not in said and "b-warned" in said, said
    assert [r["planner"] for r in rows] == ["a"] and reals["b"] == ["result"]


def test_a_planner_refused_in_simulation_keeps_its_warnings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Class: a refused run's warnings said as another's, for a planner refused while it is
    planned and simulated (its warning was held for the next accepted plan)."""
    from experiments import validate
    from experiments.common.held_warnings import plan_accepted, warnings_held

    def sized(run: Any) -> Any:
        _warns_then(run.planner, refuse=run.planner == "a")
        return _Spec(), run.planner

    monkeypatch.setattr(validate, "RunSpec", lambda *a: types.SimpleNamespace(planner=a[3]))
    monkeypatch.setattr(validate, "sized_run", sized)
    monkeypatch.setattr(validate, "load_routing", lambda *a: None)
    monkeypatch.setattr(validate, "simulate_run", lambda *a: "sim")
    rows: list[dict[str, Any]] = []
    with warnings_held():
        sims = validate._simulate_all(_validate_setup(), rows)
        plan_accepted()  # `b`'s real run
    said = [r.getMessage() for r in caplog.records]
    assert "a-warned" not in said and "b-warned" in said, said
    assert list(sims) == ["b"] and [r["planner"] for r in rows] == ["a"]


def _said_by_then(caplog: pytest.LogCaptureFixture, seen: list[str]) -> Any:
    """A stand-in for a command's long work: what was said by the time it began, then stop."""

    def work(*a: Any, **kw: Any) -> Any:
        seen.extend(r.getMessage() for r in caplog.records)
        raise MoepipeError("reached its long work")

    return work


def _warns(fn: Any) -> Any:
    import logging

    def warned(*a: Any, **kw: Any) -> Any:
        logging.getLogger("moepipe.probe").warning("an input's warning")
        return fn(*a, **kw)

    return warned


def test_calibrates_warnings_print_before_it_measures(
    cli_here: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Class: a command with no plan to accept held its warnings to its end. calibrate's came
    after the measuring (minutes); they come once its inputs are read."""
    from experiments import calibrate

    seen: list[str] = []
    monkeypatch.setattr(calibrate, "resolve_device", _warns(calibrate.resolve_device))
    monkeypatch.setattr(calibrate, "_measure", _said_by_then(caplog, seen))
    # (another test's calibrate beside this one: its wait for it is no part of this)
    monkeypatch.setattr(calibrate, "measuring_alone", contextlib.nullcontext)
    args = [f"out={tmp_path / 'h.yaml'}", f"disk_dir={tmp_path}", "disk_mb=1"]
    one_line(cli_here("experiments.calibrate", *args), "reached its long work")
    assert "an input's warning" in seen


def test_reproduce_klotskis_warnings_print_before_it_simulates(
    cli_here: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Class: a command with no plan to accept held its warnings to its end (reproduce_klotski's
    after every simulation)."""
    from experiments import reproduce_klotski

    seen: list[str] = []
    monkeypatch.setattr(
        reproduce_klotski, "checked_workers", _warns(reproduce_klotski.checked_workers)
    )
    monkeypatch.setattr(reproduce_klotski, "run_resumable", _said_by_then(caplog, seen))
    args = [f"out={tmp_path / 'o'}", "only=[table3]", "quick=true"]
    one_line(cli_here("experiments.reproduce_klotski", *args), "reached its long work")
    assert "an input's warning" in seen


# --- 5. the ranks' forkserver starts with the stops blocked ---

SERVER_MASKS = """
import os
from pathlib import Path
from experiments.common.dist_run import _as_rank, _spawn

def line(pid, field):
    status = Path(f"/proc/{pid}/status").read_text()
    return int([l for l in status.splitlines() if l.startswith(field)][0].split()[1], 16)

def masks(rank, world, init, tmp):
    own = (line(os.getpid(), "SigBlk:"), line(os.getpid(), "SigIgn:"))
    return _as_rank(rank, tmp, lambda: (line(os.getppid(), "SigBlk:"), *own))

if __name__ == "__main__":
    print(*_spawn(1, masks, ()))
"""


def test_the_ranks_server_starts_with_sigterm_blocked_and_each_rank_unblocks_it(
    tmp_path: Path,
) -> None:
    """Class: a helper process's start-up open to a stop that is the command's. The server
    (forkserver, `python -c`) started with SIGTERM open; now blocked, as a torchrun rank's
    start-up has it, and a rank forked from it has it unblocked and at its default action."""
    import signal
    import sys

    from tests.conftest import user_env
    from tests.probes.conftest import ROOT

    script = tmp_path / "masks.py"
    script.write_text(SERVER_MASKS)
    env = dict(user_env(), PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    server_blocked, rank_blocked, rank_ignored = map(int, r.stdout.split()[-3:])
    term = 1 << (signal.SIGTERM - 1)
    assert server_blocked & term, r.stdout
    assert not rank_blocked & term and not rank_ignored & term, r.stdout
