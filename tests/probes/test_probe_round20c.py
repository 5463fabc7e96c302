"""Probe round 20c (issue 48): every command's key=value options, systematically, and the real
executor's and the distributed path's config surface.

Classes:
1. A mapping or a list given where a number belongs (`gpu_frac={a:1}`, `repeats=[1]` in a
   file) was omegaconf's own line, the value quoted back and no fix: what was given, what
   belongs, and the option to pass, as for a mapping where a string belongs.
2. NaN or infinity where a whole number belongs (`repeat=nan`), in a planner's params or a
   spec's field: "must be a finite number" said no fix; each says to pass a finite one.
3. A flag that takes no value given one (`--help=1`, `-m=1`, `--run=x`) was argparse's 8 lines
   of usage: one line naming the flag, to pass it alone.
4. A positional argument (`foo`, `dir`) was hydra's "missing EQUAL at '<EOF>'": one line that
   says options are given as key=value.
5. A mistyped flag (`--hlep`) or an option written as a flag (`--out=x`) was "unknown flag"
   with no did-you-mean, as an unknown option has: the nearest flag, or the option.
6. validate with executor.distributed=true and a planner that plans one device (flexgen)
   ran the others' real runs first and then said the planner was skipped: refused in one line
   up front, as a run refuses it; with no planners given, only the expert-parallel ones run.
7. bench.real's calibrate child that failed (a second bench calibrating the same machine at
   once) printed its error line, then the bench's "calibrating it failed (its line is above)":
   two error lines. The child's line is said in the bench's one, its progress relayed.
8. A run's key under the wrong group (`executor.lanes`, `executor.micro_batches`,
   `workload.dtype`): "unknown key" and the group's fields, none of them it; the line names the
   group's field, or the planners' param, that takes it.
9. An override two keys below a free mapping's missing entry (validate's
   `planner_params.klotski.n=3`, `hardware.gpu.overhead_us_by_kind.load.x=1`) said to add the
   entry alone (`+planner_params.klotski=VALUE`): the key given, with `+`.
10. A list or a sweep with an item beyond ASCII (`train=[law,é]`) said to quote the whole
   value (`train='[law,é]'`, one string, not a list): each such item is quoted.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from core.errors import ConfigError
from core.spec import check_finite
from experiments.common.command_options import taken_elsewhere
from experiments.common.overrides import _parsed
from experiments.common.pipeline import expert_parallel_only
from experiments.common.schema import RunSchema
from planners.registry import make_params
from tests.probes.conftest import one_line, pasted, raises_one_line

# --- 1. a mapping or a list where a number belongs ---


@pytest.mark.parametrize(
    ("module", "args", "line"),
    [
        (
            "experiments.routing_stats",
            ["seed={a:1}"],
            "seed: a mapping where an integer belongs; pass seed=<an integer>",
        ),
        (
            "experiments.make_checkpoint",
            ["model=mixtral-tiny", "out=D", "scale={a:1}"],
            "scale: a mapping where a number belongs; pass scale=<a number>",
        ),
    ],
)
def test_a_mapping_where_a_number_belongs_says_what_to_pass(
    tmp_path: Path, cli_here: Any, module: str, args: list[str], line: str
) -> None:
    args = [a.replace("=D", f"={tmp_path / 'x'}") for a in args]
    assert one_line(cli_here(module, *args)) == f"error: {line}"
    assert list(tmp_path.iterdir()) == []


def test_a_run_field_given_a_mapping_says_what_to_pass(tmp_path: Path, cli_here: Any) -> None:
    r = cli_here(
        "experiments.run",
        *["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"],
        "workload.batch_size={a:1}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    one_line(r, "workload.batch_size: a mapping where an integer belongs; pass")
    assert list(tmp_path.iterdir()) == []


# --- 2. NaN or infinity: a finite number to pass ---


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_whole_number_option_says_to_pass_one(cli_here: Any, value: str) -> None:
    r = cli_here("experiments.bench.sim", f"repeat={value}")
    one_line(r, f"repeat must be a finite number, got {value}; pass repeat=<an integer>")


def test_a_non_finite_planner_param_or_spec_field_says_to_pass_a_finite_one() -> None:
    raises_one_line(
        lambda: make_params("fiddler", {"resident_share": float("nan")}),
        "planner.params.resident_share must be a finite number, got nan; pass a finite one",
    )
    with pytest.raises(ConfigError, match="got inf; pass one"):
        check_finite("hardware.gpu", tflops=float("inf"))


# --- 3. a flag that takes no value given one ---


@pytest.mark.parametrize("flag", ["--help=1", "-m=1", "--version=2"])
def test_a_flag_given_a_value_it_takes_none_of_is_one_line(
    tmp_path: Path, cli_here: Any, flag: str
) -> None:
    bare = flag.partition("=")[0]
    r = cli_here("experiments.collect", f"dir={tmp_path}", flag)
    one_line(r, f"{flag}: {bare} takes no value; pass {bare} alone")
    assert r.stdout == ""
    assert list(tmp_path.iterdir()) == []


# --- 4. a positional argument ---


@pytest.mark.parametrize("arg", ["foo", "+dir"])
def test_a_positional_argument_says_options_are_key_value(
    tmp_path: Path, cli_here: Any, arg: str
) -> None:
    r = cli_here("experiments.collect", f"dir={tmp_path}", arg)
    one_line(r, f"{arg!r}: an argument without '='; options are given as key=value")
    assert list(tmp_path.iterdir()) == []


# --- 5. a mistyped flag, or an option written as one ---


@pytest.mark.parametrize(
    ("flag", "hint"), [("--hlep", "did you mean '--help'?"), ("--out=x", "did you mean 'out=x'?")]
)
def test_a_mistyped_flag_says_the_nearest(
    tmp_path: Path, cli_here: Any, flag: str, hint: str
) -> None:
    one_line(
        cli_here("experiments.collect", f"dir={tmp_path}", flag), f"{flag}: unknown flag; {hint}"
    )


# --- 6. validate's executor.distributed=true with a planner of one device ---


def test_validate_distributed_with_a_one_device_planner_is_refused_up_front(
    tmp_path: Path, cli_here: Any
) -> None:
    out = tmp_path / "val"
    args = ["checkpoint=CK", f"out={out}", "executor.distributed=true", "planners=[eplb,flexgen]"]
    r = cli_here("experiments.validate", *args)
    one_line(r, "planners=eplb,flexgen: executor.distributed=true", "planner flexgen plans one")
    assert not out.exists()


def test_validate_distributed_with_no_planners_given_runs_the_expert_parallel_ones() -> None:
    names = ["eplb", "flexgen", "klotski", "ep_static"]
    assert expert_parallel_only(names, []) == ["eplb", "ep_static"]
    assert expert_parallel_only(["eplb"], ["eplb"]) == ["eplb"]


# --- 7. bench.real's calibrate child: its error said in the bench's one line ---


def test_a_failed_child_of_bench_real_is_said_in_its_line(capsys: pytest.CaptureFixture) -> None:
    from experiments.bench.real import _run_child

    said = "import sys; print('calibrating', file=sys.stderr); sys.exit('error: x is busy')"
    assert _run_child([sys.executable, "-c", said]) == "x is busy"
    assert capsys.readouterr().err == "calibrating\n"  # its progress, not its error line
    assert _run_child([sys.executable, "-c", "import sys; sys.exit(3)"]) == "exit status 3"
    assert _run_child([sys.executable, "-c", "pass"]) == ""


# --- 8. a run's key under the wrong group ---


def test_a_run_key_under_the_wrong_group_names_where_it_goes(tmp_path: Path, cli_here: Any) -> None:
    args = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]
    r = cli_here("experiments.run", *args, "executor.micro_batches=2", f"hydra.run.dir={tmp_path}")
    one_line(r, "executor.micro_batches: unknown key", "; planner.params.micro_batches (ep_static")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("key", "said"),
    [
        ("workload.dtype", "; executor.dtype takes it"),
        ("hardware.distributed", "; executor.distributed takes it"),
        ("planner.gen_len", "; workload.gen_len takes it"),
        ("workload.nosuch", ""),
        ("lanes", ""),  # a top-level key: taken_by's
    ],
)
def test_taken_elsewhere_names_the_group_that_takes_a_key(key: str, said: str) -> None:
    assert taken_elsewhere(key, RunSchema) == said
    assert taken_elsewhere(key, None) == ""  # another command's: its own schema's words


# --- 9. an override below a free mapping's missing entry ---


def test_an_override_below_a_missing_entry_says_to_add_the_key_given(
    tmp_path: Path, cli_here: Any
) -> None:
    args = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]
    given = "hardware.gpu.overhead_us_by_kind.load.x"
    r = cli_here("experiments.run", *args, f"{given}=1", f"hydra.run.dir={tmp_path}")
    one_line(r, f"add one with +{given}=VALUE")


# --- 10. an item beyond ASCII in a list or a sweep ---


@pytest.mark.parametrize(
    ("value", "fix"),
    [("é", "'é'"), ("[law,é]", "[law,'é']"), ("[é]", "['é']"), ("a,é", "a,'é'")],
)
def test_an_item_beyond_ascii_is_quoted_alone(value: str, fix: str) -> None:
    line = raises_one_line(lambda: _parsed(f"train={value}"), "must be quoted: ")
    assert pasted(line.rpartition("must be quoted: ")[2]) == f"train={fix}", line
