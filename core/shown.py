"""How a number is printed where rounding would say more than it is: `fixed` keeps a small
number's digits (a 10 us makespan is 1.04e-05 s, not 0.00 s), `short_of` keeps a share, an
error or an efficiency off a bound it does not reach (99.53% of a bubble is 99.5%, not 100%).

Usage: f"{fixed(makespan_s)} s", short_of(share, ".0%", 0, 1), error(sim / real - 1)
"""

from __future__ import annotations

import math
import re


def fixed(x: float, places: int = 2) -> str:
    """`x` to `places` decimals, or to 3 significant digits where the decimals would show fewer
    (a 10 us makespan is 1.04e-05, not 0.00; a 0.4 ms one 0.0004, not 0.00)."""
    x += 0.0  # -0.0 (a product of 0 and a negative) reads 0.00, not -0.00
    if x != 0 and math.isfinite(x) and abs(x) < 10.0 ** (2 - places):
        return f"{x:.3g}"
    return f"{x:.{places}f}"


def gb(nbytes: int) -> float:
    """`nbytes` in GB for summary.json: to 3 decimals, or to 3 significant digits where the
    decimals would show 0 GB of bytes a run holds (a tiny model's 393216 B is 0.000393)."""
    return float(fixed(nbytes / 1e9, 3))


def short_of(x: float, spec: str, *bounds: float) -> str:
    """`format(x, spec)` (`spec` such as ".1f", "+.0%", ".4g"), with up to 3 more digits where
    it would print one of `bounds` that `x` is not: a share of 0.9953 as `.0%` reads 99.5%, not
    100% (all of it); an error of -0.9998 -99.98%, not -100% (a prediction of nothing); an
    efficiency of 0.9996 as `.3f` 0.9996, not 1.000; nearer still, the significant digits that
    tell it from the bound (an error of 1e-9 is +1e-07%, not +0.0000%). `bounds` are values of
    `x` (1 for 100%)."""
    parts = re.fullmatch(r"([+ ]?)\.(\d+)([fg%])", spec)
    assert parts, f"{spec!r}: a sign, a precision and f, g or %"
    sign, places, kind = parts.groups()
    x += 0.0  # -0.0 reads 0%, not -0%
    shown = format(x, spec)
    for more in range(1, 4):
        if x in bounds or _value(shown) not in bounds:
            return shown
        shown = format(x, f"{sign}.{int(places) + more}{kind}")
    for digits in range(3, 18):  # still a bound x is not (1e-9 is not +0.0000%): digits
        if x in bounds or _value(shown) not in bounds:
            break
        shown = f"{x * 100:{sign}.{digits}g}%" if kind == "%" else format(x, f"{sign}.{digits}g")
    return shown


def _value(shown: str) -> float:
    return float(shown[:-1]) / 100 if shown.endswith("%") else float(shown)


def error(x: float, places: int = 1) -> str:
    """A prediction's relative error as a signed percent, off -100% (a prediction of nothing)
    and 0% (an exact one) where it is neither: -0.9998 reads -99.98%, 0.0004 +0.04%."""
    return short_of(x, f"+.{places}%", -1, 0)
