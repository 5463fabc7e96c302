"""Probe round 21a (issue 48): the leftovers of round 20.

Classes:
1. Two wordings for a value that is not an integer: `as_int`, hydra's type errors and the
   summary checks said "not a whole number", core.errors' integer fields "must be an
   integer". Every line now says "must be an integer" (or the bound's words, "must be a
   positive integer"), and "must be a number" / "must be true or false" for the other kinds.
"""

from __future__ import annotations

import pytest
import yaml

from core.args import as_int
from experiments.common.app import check_keys
from experiments.common.hydra_errors import _wrong_type
from experiments.common.schema import HardwareSchema
from tests.probes.conftest import ROOT, raises_one_line

TINY_HW = yaml.safe_load((ROOT / "conf" / "hardware" / "tiny.yaml").read_text())


@pytest.mark.parametrize(
    ("fn", "words"),
    [
        (lambda: as_int("jobs", "two"), "jobs=two: must be an integer"),
        (lambda: as_int("jobs", "2.5", at_least=1), "jobs=2.5: must be a positive integer"),
        (
            lambda: check_keys(HardwareSchema, {**TINY_HW, "n_gpus": "x"}, "hw.yaml"),
            "n_gpus=x: must be an integer",
        ),
    ],
)
def test_not_an_integer_is_said_in_one_wording(fn, words):
    """`as_int` and hydra's type errors said "not a whole number", integer fields "must be an
    integer": one project, two wordings of one refusal."""
    line = raises_one_line(fn, words)
    assert "whole number" not in line


def test_hydra_type_lines_say_must_be():
    """omegaconf's type error for a number and a bool: "must be", as an integer field's."""
    assert "k=abc: must be a number" in str(
        _wrong_type("Value 'abc' could not be converted to Float", "k", "")
    )
    assert "k=2: must be true or false" in str(
        _wrong_type("Value '2' is not a valid bool (type: str)", "k", "")
    )
