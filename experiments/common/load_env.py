"""Environment variables the numeric libraries read once, as torch loads: a value they refuse
printed libgomp's or torch's warning in two lines above the run (OMP_NUM_THREADS=abc, OMP_DYNAMIC,
TORCH_SHOW_CPP_STACKTRACES) or, for MKL_NUM_THREADS=abc, ran on one thread without a word. A
command checks them before it imports torch (`bad_variable`); stdlib only, as it runs first."""

from __future__ import annotations

import re

# OpenMP's list of thread counts per nesting level ("4" or "4,2"), MKL's single count
_COUNTS = {
    "OMP_NUM_THREADS": re.compile(r"\s*[1-9][0-9]*(\s*,\s*[1-9][0-9]*)*\s*"),
    "MKL_NUM_THREADS": re.compile(r"\s*([1-9][0-9]*)?\s*"),  # empty: as unset
}
_FLAGS = {  # variable -> the values it takes (case-insensitive, as libgomp reads them)
    "OMP_DYNAMIC": ("true", "false"),
    "TORCH_SHOW_CPP_STACKTRACES": ("0", "1"),
}


def bad_variable(env: dict[str, str]) -> str | None:
    """One line naming the first variable of `env` set to a value its library refuses, or
    None."""
    for name, form in _COUNTS.items():
        value = env.get(name)
        if value is not None and not form.fullmatch(value):
            return (
                f"environment variable {name}={value!r} is not a thread count (a whole number "
                f"above 0{', or a list like 4,2' if ',' in form.pattern else ''}); set it, e.g. "
                f"{name}=2, or unset it"
            )
    for name, values in _FLAGS.items():
        value = env.get(name)
        if value is not None and value.strip().lower() not in values:
            return (
                f"environment variable {name}={value!r} takes {' or '.join(values)}; set it to "
                "one of them, or unset it"
            )
    return None
