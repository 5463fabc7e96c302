"""Probe round 18a (issue 48): the simulated and analysis commands, by class of failure.

A non-finite planner param said its planner's own range ("must be a finite number >= 0",
"must be an integer", "must be in (0, 1]"): every numeric param of every planner says "KEY must
be a finite number, got VALUE", the wording of every other number's check.
"""

from __future__ import annotations

import typing

import pytest

from tests.probes.conftest import raises_one_line


def _numeric_params() -> list[tuple[str, str]]:
    from planners.registry import entry, planner_names

    found = []
    for name in planner_names():
        for key, hint in typing.get_type_hints(entry(name).params).items():
            options = typing.get_args(hint) or (hint,)
            if int in options or float in options:
                found.append((name, key))
    return found


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), ".inf", "-.Inf"])
def test_every_planners_non_finite_param_is_said_in_one_wording(value: object) -> None:
    """Every numeric param of every registered planner (prior_weight said "must be a finite
    number >= 0", an integer param "must be an integer", a share "must be in (0, 1]")."""
    from planners.registry import make_params

    params = _numeric_params()
    assert len(params) > 20
    for name, key in params:
        raises_one_line(
            lambda n=name, k=key: make_params(n, {k: value}),
            f"planner {name}: planner.params.{key} must be a finite number, got {value}",
        )
