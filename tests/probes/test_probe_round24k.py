"""Round 24k of issue 48: what this session built, probed as an adversarial user. Classes:

1. a path holding a bracket, a brace or a parenthesis in a folder's name (`runs/a[1]`,
   `out/b(2)`), given to any command (`hydra.run.dir=`, report's `dir=`, `out=`), ended in
   hydra's own grammar line, "mismatched input '[' expecting <EOF>", which does not say that
   quoting it is the fix. Now the line names the character and the override quoted.
2. a run dir's path holding `=` and a comma whose piece after it is no `key=value`
   (`runs/a=b,c d`) was told to quote itself as two values (`"'runs/a=b','c d'"`), a sweep
   that one run cannot take: following the fix failed again. Now it is quoted whole.
3. `core.shown` printed -0.0 (a product of 0 and a negative) as -0.00 / -0% / -0.0%, and a
   number nearer a bound than 3 more digits tell (an error of 1e-9, an efficiency of
   0.99999999) at that bound (+0.0000%, 1.000): the bound it is not. Now -0.0 reads 0 and
   such a number is printed to the significant digits that tell it from the bound.
4. make_checkpoint's `scale=1e-300` (any scale whose largest weight is below the dtype's
   smallest normal number) wrote a model of zeros with exit 0, where `scale=1e300`'s overflow
   is refused. Now both ends are refused in one line naming the scale the dtype takes.
5. a researcher's planner giving an op's step, layer, batch, expert or byte count a value no
   column holds (None, NaN, 10**20, a list) ended in numpy's TypeError, ValueError or
   OverflowError from `Schedule.columns`: a traceback; a unit of 0.5 was read as 0 without
   a word. Now each is the planner's one line naming the op, the field and its value.
6. a link in a sweep folder that leads nowhere (a run dir linked in, then moved; a loop) was
   passed over by collect and report without a word; now a skipped point naming the link.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.errors import PlannerBug
from core.shown import error, fixed, short_of
from core.spec import Workload
from core.types import OpKind
from experiments.common.cli import any_error_line
from experiments.common.overrides import _parsed
from experiments.common.pipeline import RunSpec, build_schedule
from experiments.make_checkpoint import check_scale
from planners import registry
from planners.sequential import Sequential
from tests.conftest import hardware_from_conf, model_from_conf, random_routing
from tests.probes.conftest import pasted, raises_one_line
from tests.probes.test_probe_round24c import _NoParams

# --- 1. a bracket, a brace or a parenthesis inside a path ---


@pytest.mark.parametrize("name", ["a[1]", "a]b", "a{b}", "b(2)", "x)y"])
@pytest.mark.parametrize("key", ["hydra.run.dir", "dir", "out"])
def test_a_path_holding_a_bracket_says_to_quote_it(key: str, name: str) -> None:
    path = f"/tmp/runs/{name}"
    line = raises_one_line(lambda: _parsed(f"{key}={path}"), "must be quoted: ")
    fix = pasted(line.rpartition("must be quoted: ")[2])
    assert fix == f"{key}='{path}'", line
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
    line = raises_one_line(lambda: _parsed(f"dir={value}"), "must be quoted: ")
    quoted = pasted(line.rpartition("must be quoted: ")[2]).removeprefix("dir=")
    assert quoted == fix, line
    want = [i.strip("'") for i in fix[1:-1].split("','")] if value[0] == "[" else value
    assert _parsed(f"dir={quoted}").value() == want


# --- 3. core.shown at -0.0 and nearer a bound than 3 more digits ---


@pytest.mark.parametrize(
    ("shown", "want"),
    [
        (lambda: fixed(-0.0), "0.00"),
        (lambda: fixed(-0.0, 0), "0"),
        (lambda: error(-0.0), "+0.0%"),
        (lambda: short_of(-0.0, ".0%", 0, 1), "0%"),
        (lambda: error(1e-9), "+1e-07%"),
        (lambda: error(-1e-300), "-1e-298%"),
        (lambda: short_of(1e-300, ".0%", 0, 1), "1e-298%"),
        (lambda: short_of(0.99999999, ".0%", 0, 1), "99.999999%"),
        (lambda: short_of(0.99999999, ".3f", 1), "0.99999999"),
        (lambda: short_of(1 - 2**-53, ".3f", 1), "0.9999999999999999"),
        (lambda: error(-1 + 1e-12), "-99.9999999999%"),
        (lambda: error(0.0), "+0.0%"),  # at a bound: as the spec prints it
        (lambda: short_of(1.0, ".0%", 0, 1), "100%"),
        (lambda: error(-0.9998), "-99.98%"),  # 3 more digits tell it: as before
    ],
)
def test_a_number_is_not_shown_at_a_bound_it_is_not(shown: object, want: str) -> None:
    assert shown() == want  # type: ignore[operator]


# --- 4. make_checkpoint's scale too small for its dtype ---


@pytest.mark.parametrize(
    ("model", "scale", "said"),
    [
        ("mixtral-tiny", 1e-300, "below torch.float32's smallest normal number"),
        ("mixtral-tiny", 1e-40, "pass scale in [4.26e-36, 3.4e+37]"),
        ("tiny", 1e-300, "below torch.bfloat16's smallest normal number"),
    ],
)
def test_a_scale_that_writes_every_weight_as_zero_is_refused(
    model: str, scale: float, said: str
) -> None:
    raises_one_line(lambda: check_scale(model_from_conf(model), scale), f"scale={scale:g}", said)


@pytest.mark.parametrize("scale", [1e-35, 1.0, 1e37])
def test_a_scale_within_the_dtype_is_taken(scale: float) -> None:
    check_scale(model_from_conf("mixtral-tiny"), scale)


# --- 5. a researcher's planner giving an op's field a value no column holds ---


class _Odd(Sequential):
    """`sequential`'s plan and one more expert compute whose `field` is `value`."""

    field, value = "layer", None

    def plan(self, ctx: Any, out: Any) -> Any:
        super().plan(ctx, out)
        units = {"step": 0, "layer": 0, "batch": 0, "expert": 0, self.field: self.value}
        out.add(OpKind.EXPERT, "compute", **units)


@pytest.fixture(scope="module")
def tiny_plan() -> tuple[Any, Any, Workload, Any]:
    model, hw = model_from_conf("tiny"), hardware_from_conf("tiny")
    wl = Workload(batch_size=2, n_batches=2, prompt_len=8, gen_len=3)
    return model, hw, wl, random_routing(model, wl)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("layer", None),
        ("step", float("nan")),
        ("batch", 10**20),
        ("expert", [0]),
        ("nbytes", "many"),
    ],
)
def test_an_op_field_no_column_holds_is_one_line_naming_it(
    field: str, value: Any, tiny_plan: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, hw, wl, routing = tiny_plan
    cls = type("Odd", (_Odd,), {"field": field, "value": value})
    monkeypatch.setitem(registry._REGISTRY, "mine", registry.Entry("mine", cls, _NoParams))
    with pytest.raises(PlannerBug) as e:
        build_schedule(RunSpec(model, hw, wl, "mine", {}), routing)
    line = any_error_line(e.value)
    assert line.startswith("planner mine") and "\n" not in line, line
    assert f"{field}={value!r:.40} is not a " in line and f"every op's {field}" in line, line


class _Half(Sequential):
    """`sequential`'s plan with its first op's `field` half a unit on."""

    field = "layer"

    def plan(self, ctx: Any, out: Any) -> Any:
        super().plan(ctx, out)
        out.ops[0] = out.ops[0]._replace(**{self.field: getattr(out.ops[0], self.field) + 0.5})


@pytest.mark.parametrize("field", ["step", "layer", "batch"])
def test_an_op_unit_that_is_not_whole_is_refused_not_truncated(
    field: str, tiny_plan: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, hw, wl, routing = tiny_plan
    cls = type("Half", (_Half,), {"field": field})
    monkeypatch.setitem(registry._REGISTRY, "mine", registry.Entry("mine", cls, _NoParams))
    with pytest.raises(PlannerBug) as e:
        build_schedule(RunSpec(model, hw, wl, "mine", {}), routing)
    line = any_error_line(e.value)
    assert f"{field}=0.5 is not a whole number" in line and "\n" not in line, line


@pytest.mark.parametrize("target", ["gone", "self"])
def test_a_link_in_a_sweep_that_leads_nowhere_is_named(tmp_path: Path, target: str) -> None:
    """A run dir linked into a sweep and then moved or deleted (or a link that loops): collect
    and report skipped it without a word; it is now a skipped point naming the link."""
    from experiments.common.tables import read_run, run_dirs

    link = tmp_path / "b"
    link.symlink_to(tmp_path / "gone" if target == "gone" else link)
    (tmp_path / "summary.json.txt").symlink_to(tmp_path / "gone2")  # any name: a link, named
    assert run_dirs(tmp_path) == [link, tmp_path / "summary.json.txt"]
    row, why = read_run(link)
    assert row is None and why is not None and why.startswith("not a run dir (a symbolic link")
    assert why.endswith("point the link at one, or remove it"), why
