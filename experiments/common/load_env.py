"""Environment variables the numeric libraries read once, as torch loads: a value they refuse
printed libgomp's or torch's warning in two lines above the run (OMP_NUM_THREADS=abc, OMP_DYNAMIC,
TORCH_SHOW_CPP_STACKTRACES) or, for MKL_NUM_THREADS=abc, ran on one thread without a word. A
command checks them before it imports torch (`bad_variable`); stdlib only, as it runs first.
Other OpenMP variables (OMP_WAIT_POLICY, OMP_PLACES, GOMP_CPU_AFFINITY, ...) are judged by
libgomp itself, loaded alone in a child process (`openmp_complaint`): GOMP_CPU_AFFINITY=x made it
loop forever as torch loaded."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

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
                f"environment variable {name}={value!r} is not a thread count (an integer "
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


OPENMP_PREFIXES = ("OMP_", "GOMP_")
LOAD_TIMEOUT_S = 10.0  # libgomp loads in 0.1-0.2 s here


def openmp_complaint(env: dict[str, str]) -> str | None:
    """One line where libgomp (torch's own) refuses an OpenMP variable of `env` other than those
    checked above, or does not finish loading with them; None where it takes them, where none is
    set, or where torch ships no libgomp. libgomp's constructor reads them as it loads, so it is
    loaded alone in a child with `env`, and its complaints are read from the child's stderr."""
    others = sorted(
        k for k in env if k.startswith(OPENMP_PREFIXES) and k not in _COUNTS and k not in _FLAGS
    )
    lib = _libgomp() if others else None
    if lib is None:
        return None
    given = ", ".join(f"{k}={env[k]!r}" for k in others)
    load = "import ctypes, sys; ctypes.CDLL(sys.argv[1])"
    try:
        r = subprocess.run(
            [sys.executable, "-S", "-c", load, lib],
            env=env,
            capture_output=True,
            text=True,
            timeout=LOAD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return (
            f"OpenMP (libgomp) did not finish loading in {LOAD_TIMEOUT_S:g} s with {given} set "
            "(a GOMP_CPU_AFFINITY it cannot parse makes it loop forever); fix or unset them"
        )
    except OSError:  # no child to start: torch's own load says what it says
        return None
    said = [
        ln.removeprefix("libgomp: ") for ln in r.stderr.splitlines() if ln.startswith("libgomp")
    ]
    if not said:
        return None
    named = re.search(r"variable (\w+)", said[0])
    where = f"{named.group(1)}={env.get(named.group(1), '')!r}" if named else given
    return f"environment variable {where}: libgomp says {said[0]!r}; fix it or unset it"


def _libgomp() -> str | None:
    """The libgomp torch ships (torch/lib/libgomp*.so*), found without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        found = sorted(Path(folder, "lib").glob("libgomp*.so*"))
        if found:
            return str(found[0])
    return None
