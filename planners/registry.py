"""Planner registry: `@register("name", Params)` in a planner's own file; the name is the stem
of `conf/planner/<name>.yaml`, and further YAMLs there may be params variants of a registered
planner (klotski_at_n, klotski_hot, klotski_multi: `name: klotski`). Params are frozen dataclasses
of primitives.

Usage:
    planner = make_planner("flexgen", {"sync": False})
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import numbers
import pkgutil
import re
import subprocess
import sys
import traceback
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

from core.args import non_finite
from core.errors import ConfigError, MoepipeError, PlannerBug, ScheduleBug, did_you_mean
from core.planner import Planner


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Callable[[Any], Planner]  # Params -> planner
    params: type  # frozen dataclass of primitives


_REGISTRY: dict[str, Entry] = {}
# a planner file that did not import (a name taken, a syntax error): raised at the registry's
# first use, inside a command's one error path, not at the import every command makes
_BROKEN: list[ConfigError] = []

T = TypeVar("T")


def register(name: str, params: type) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        where = _file_of(cls)
        had = _REGISTRY.get(name)
        if had is not None and _file_of(had.factory) != where:  # not the same file read again
            raise ConfigError(
                f"{where}: planner name {name!r} is taken by {_file_of(had.factory)}; "
                f"give @register another name (and conf/planner/<name>.yaml its stem)"
            )
        if not (isinstance(params, type) and dataclasses.is_dataclass(params)):
            raise ConfigError(
                f"{where}: @register({name!r}, {getattr(params, '__name__', params)}): its params "
                "must be a class: a frozen dataclass of primitives (@dataclass(frozen=True))"
            )
        odd = _not_primitive(params)
        if odd:
            raise ConfigError(
                f"{where}: @register({name!r}, {params.__name__}): {odd}; "
                "params are primitives (bool, int, float, str, or a union of them with None), "
                "which a YAML file and an override give: use one (a str for a list of names)"
            )
        _REGISTRY[name] = Entry(name, cls, params)  # type: ignore[arg-type]
        return cls

    return deco


def _not_primitive(params: type) -> str:
    """The first field of dataclass `params` whose type is not a primitive, as `P.name is TYPE`
    (a tuple arrives from YAML as a list, unchecked and unhashable); "" if none."""
    try:
        hints = typing.get_type_hints(params)
    except Exception as e:  # a hint that names nothing importable
        return f"a type hint of {params.__name__} does not resolve ({e})"
    for f in fields(params):
        hint = hints[f.name]
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        options = typing.get_args(hint) if union else (hint,)
        if not all(t in _KINDS or t is type(None) for t in options):
            shown = hint.__name__ if isinstance(hint, type) else str(hint)
            return f"{params.__name__}.{f.name} is {shown}"
    return ""


def _file_of(obj: Any) -> str:
    """The file, as a path from the repository root, that defines class `obj`."""
    return obj.__module__.replace(".", "/") + ".py"


def import_planners(path: list[str], package: str) -> None:
    """Import every module of `package` (at `path`), each registering its planners. One that
    fails (a planner name taken, a syntax error, a missing import) is kept as one line naming
    its file, raised by the registry's first use (`_load_all`)."""
    for m in pkgutil.iter_modules(path):
        module = f"{package}.{m.name}"
        try:
            importlib.import_module(module)
        except ConfigError as e:
            _BROKEN.append(e)
        except SyntaxError as e:
            _BROKEN.append(_broken(module, f"line {e.lineno}: {e.msg} (SyntaxError)", e))
        except Exception as e:  # the user's own file: whatever its import raised
            _BROKEN.append(_broken(module, f"{type(e).__name__}: {e}", e))


def _broken(module: str, what: str, cause: Exception) -> ConfigError:
    """The line for planner module `module` whose import raised `cause` (`what`)."""
    error = ConfigError(
        f"{module.replace('.', '/')}.py: the planner file does not import ({what}); fix it, "
        "or move it out of planners/"
    )
    error.__cause__ = cause
    return error


def planner_names() -> list[str]:
    _load_all()
    return sorted(_REGISTRY)


def registered() -> dict[str, Entry]:
    """The planners registered, with no error for a planner file that did not import: for what
    an import of a command does (its schemas stored), whose first use of the registry then
    names that file (`_load_all`)."""
    import planners  # noqa: F401  (imports every planner module, which registers it)

    return dict(sorted(_REGISTRY.items()))


def expert_parallel_names() -> list[str]:
    """The expert-parallel planners (params an `EPParams`): they keep every expert resident on
    G devices and place copies of them, so they refuse to offload and share the replication
    experiment's options."""
    from planners.ep.params import EPParams

    _load_all()
    return sorted(n for n, e in _REGISTRY.items() if issubclass(e.params, EPParams))


def entry(name: str) -> Entry:
    _load_all()
    if name not in _REGISTRY:
        raise ConfigError(
            f"unknown planner {name!r}; {did_you_mean(name, _REGISTRY)}"
            f"valid: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[name]


def param_names(name: str) -> set[str]:
    """The params planner `name` takes."""
    return {f.name for f in fields(entry(name).params)}


def make_params(name: str, values: Mapping[str, Any] | None = None) -> Any:
    cls = entry(name).params
    values = dict(values or {})
    valid = param_names(name)
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ConfigError(
            f"planner {name}: unknown param(s) {', '.join(unknown)}; "
            + (
                f"{did_you_mean(unknown[0], valid)}valid: {', '.join(sorted(valid))}"
                if valid
                else f"{name} takes none: leave planner.params out"
            )
        )
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if _numeric(hints[key]) and non_finite(value):  # in every number's one wording
            raise ConfigError(
                f"planner {name}: planner.params.{key} must be a finite number, got {value}; "
                "pass a finite one"
            )
        need = _mismatch(hints[key], value)
        if need:
            raise ConfigError(
                f"planner {name}: planner.params.{key}={value!r} must be {need}; pass "
                f"planner.params.{key}=<{need}>"
            )
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        line = as_typed(name, str(e))
        said = ";" in re.sub(r"\([^)]*\)", "", line)  # a fix of its own (not inside a note)
        fix = "" if said else f"; pass one it allows (conf/planner/{name}.yaml: defaults)"
        raise ConfigError(line + fix) from None


# what follows a param's name where a line speaks of its value: `=2`, `<= 8`, `must be`
_SAID_OF = r"=|\s*(?:<=|>=|<|>)\s|\s+(?:must|exceeds|is)\b"


@contextlib.contextmanager
def own_errors(name: str) -> Iterator[None]:
    """Inside, planner `name`'s own ConfigError (a line that begins with its name, raised as it
    plans) is `as_typed`'s line: its params by the keys a user types, its name once."""
    try:
        yield
    except ConfigError as e:
        msg = str(e)
        if re.match(rf"(?:planner )?{re.escape(name)}\b", msg) is None:
            raise
        raise ConfigError(as_typed(name, msg)) from None


@contextlib.contextmanager
def own_bugs(name: str) -> Iterator[None]:
    """Inside, a ScheduleBug of planner `name` (registered) that the project does not ship is a
    PlannerBug naming it and the rule its schedule breaks, the researcher's to fix, and so is
    an IndexError, KeyError or ValueError raised in its own file (`_slip`); one of the
    project's own planners stays a bug to report."""
    try:
        yield
    except (IndexError, KeyError, ValueError) as e:
        line = _slip(name, e)
        if line is None:
            raise
        raise PlannerBug(line) from e
    except ScheduleBug as e:
        if isinstance(e, PlannerBug) or name in project_planners():
            raise
        if str(e).startswith(f"planner {name}: "):  # a check that names it (the run's work)
            raise PlannerBug(str(e)) from None
        raise PlannerBug(
            f"planner {name}'s schedule breaks the schedule IR: {e}; fix planner {name} "
            "(docs/architecture.md: the schedule IR; core.schedule.validate checks it)"
        ) from None


# what a planner may index, each within its run's count
_WITHIN = (
    "index layers, experts, batches and steps below ctx.model.n_layers, ctx.model.n_experts, "
    "ctx.workload.n_batches and ctx.workload.n_steps"
)


def _slip(name: str, e: Exception) -> str | None:
    """The line for `e`, raised in the file of planner `name` (one the project does not ship)
    by its own code: an index past its run's (`planned outside`), or its own `raise` (its
    message, as its author wrote it). None for any other: a project's file's, a check's."""
    found = _REGISTRY.get(name)
    if isinstance(e, MoepipeError) or found is None or name in project_planners():
        return None
    frames = traceback.extract_tb(e.__traceback__)
    file = _source(found.factory)
    if not frames or file is None or Path(frames[-1].filename).resolve() != file:
        return None
    frame = frames[-1]
    shown = file.relative_to(Path.cwd()) if file.is_relative_to(Path.cwd()) else file
    what = " ".join(str(e).split())[:200]
    where = f"at {shown}:{frame.lineno} in {frame.name}"
    if (frame.line or "").startswith("raise"):
        return f"{as_typed(name, what)} ({type(e).__name__}, {where}); fix planner {name} there"
    return (
        f"planner {name} planned outside its run's model or workload ({type(e).__name__}: "
        f"{what}, {where}): {_WITHIN}, and fix planner {name} there"
    )


def project_planners() -> frozenset[str]:
    """The planners the project ships, whose broken schedule is the project's bug to report:
    those defined in a file of this `planners` package that the project's git tracks (any file
    of it where the package is not a git checkout's, an installed copy). A researcher's own,
    registered from a file of its own or added to planners/ and not committed, is theirs."""
    _load_all()
    return frozenset(n for n, e in _REGISTRY.items() if _shipped(e.factory))


def _shipped(obj: Any) -> bool:
    """Is class `obj` defined in a file of this package that the project ships?"""
    path = _source(obj)
    tracked = _tracked_files()
    here = Path(__file__).resolve().parent
    return path is not None and path.is_relative_to(here) and (tracked is None or path in tracked)


def _source(obj: Any) -> Path | None:
    """The file, resolved, of the module that defines class `obj`; None if it has none."""
    file = getattr(sys.modules.get(obj.__module__), "__file__", None)
    return None if file is None else Path(file).resolve()


@functools.cache
def _tracked_files() -> frozenset[Path] | None:
    """The files of this package the project's git tracks, resolved; None where the package is
    not in the project's git checkout (or git is not there)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "ls-files", "-z", "--", "."],
            capture_output=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    tracked = frozenset((here / p).resolve() for p in out.decode().split("\0") if p)
    # a copy inside another project's checkout (a virtual environment's), which tracks none
    return tracked if Path(__file__).resolve() in tracked else None


def as_typed(name: str, msg: str) -> str:
    """Planner `name`'s own error `msg` as one line a user can act on: `planner NAME: ` once
    (a planner's line began `eplb: ` inside it), and each of its params named by the key a user
    types (`resident_share=2` as `planner.params.resident_share=2`)."""
    body = msg
    while True:  # "planner eplb: eplb: ...": each prefix off
        rest = re.sub(rf"^(?:planner {re.escape(name)}|{re.escape(name)})\s*:\s*", "", body)
        if rest == body:
            break
        body = rest
    for param in param_names(name):  # `param=`, `planner param`: not inside a dotted key
        body = re.sub(
            rf"(?<![\w.]){re.escape(param)}(?={_SAID_OF})", f"planner.params.{param}", body
        )
        body = re.sub(rf"\bplanner {re.escape(param)}\b", f"planner.params.{param}", body)
    return f"planner {name}: {body}"


_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _numeric(hint: Any) -> bool:
    """Does a param of type `hint` take a number (an int or a float, maybe among others)?"""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    return int in options or float in options


def _mismatch(hint: Any, value: Any) -> str:
    """What a param of type `hint` must be when `value` is not that ("" when it fits). Params are
    primitives (bool, int, float, str, or a union of them with None); other hints pass."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [t for t in options if t in _KINDS]
    if len(kinds) < len([t for t in options if t is not type(None)]):
        return ""  # a container or other type: the dataclass's own checks apply
    if value is None and type(None) in options:
        return ""
    for t in kinds:
        if t is bool and isinstance(value, bool):
            return ""
        if t is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return ""
        if t is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
            return ""
        if t is str and isinstance(value, str):
            return ""
    return " or ".join(_KINDS[t] for t in kinds) + (" or null" if type(None) in options else "")


def make_planner(name: str, values: Mapping[str, Any] | None = None) -> Planner:
    return entry(name).factory(make_params(name, values))


def _load_all() -> None:
    import planners  # noqa: F401  (imports every planner module, which registers it)

    if _BROKEN:
        raise _BROKEN[0]
