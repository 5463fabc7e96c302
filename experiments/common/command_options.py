"""Which commands take an option: a key one command does not know may be another's
(`gpu_frac=` given to experiments.bench.host is experiments.bench.accelerate's), and its line
names them. Read from the commands' sources (conf/command/*.yaml name each module), not by
importing them: the error path stays fast and loads no torch.

Usage:
    line += taken_by("gpu_frac")  # "; experiments.bench.accelerate, experiments.bench.real take it"
    line += taken_elsewhere("executor.lanes", RunSchema)  # "; planner.params.lanes (of ...) ..."
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# experiments.run's schema, whose config is conf/config.yaml, not a conf/command/ one
_RUN = ("experiments.run", "experiments/common/schema.py", "RunSchema")


def taken_by(option: str) -> str:
    """`; M1, M2 take it` naming the commands whose options include `option` (a top-level key);
    empty when none does."""
    which = [module for module, names in _options().items() if option in names]
    if not which:
        return ""
    return f"; {', '.join(which)} {'takes' if len(which) == 1 else 'take'} it"


# experiments.run's groups whose fields a user may put under another (`executor.lanes`)
_GROUPS = ("model", "hardware", "workload", "executor")


def taken_elsewhere(key: str, root: type | None) -> str:
    """`; planner.params.lanes takes it (ep_static, eplb, ...)` for `executor.lanes`, a key of
    experiments.run (`root` its RunSchema) under one group that is another group's field or a
    planner's param; empty for any other key or command."""
    group, _, name = key.partition(".")
    if getattr(root, "__name__", "") != "RunSchema" or group not in (*_GROUPS, "planner"):
        return ""
    schema = ROOT / _RUN[1]
    where = [
        f"{g}.{name}"
        for g in _GROUPS
        if g != group and name in _fields(schema, f"{g.capitalize()}Schema", set())
    ]
    from planners.registry import param_names, planner_names

    takes = [p for p in planner_names() if name in param_names(p)]
    if takes and group != "planner":
        where.append(f"planner.params.{name} ({', '.join(takes)})")
    return f"; {' and '.join(where)} {'takes' if len(where) == 1 else 'take'} it" if where else ""


@functools.cache
def _options() -> dict[str, frozenset[str]]:
    """Each command's module -> its options' names (a schema's fields, its bases' too)."""
    found = {_RUN[0]: frozenset(_fields(ROOT / _RUN[1], _RUN[2], set()))}
    for conf in sorted((ROOT / "conf" / "command").glob("*.yaml")):
        head = re.match(r"# python -m (\S+?):?\s", conf.read_text(encoding="utf-8"))
        path = head and ROOT / (head.group(1).replace(".", "/") + ".py")
        if path is None or not path.is_file():
            continue
        schema = _schema_name(path, conf.stem)
        if schema:
            found[head.group(1)] = frozenset(_fields(path, schema, set()))
    return found


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _schema_name(path: Path, name: str) -> str | None:
    """The schema handed to `command(name, SCHEMA, ...)` (or timed_command) in `path`."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call) and len(node.args) > 1:
            first, second = node.args[0], node.args[1]
            if isinstance(first, ast.Constant) and first.value == name:
                return second.id if isinstance(second, ast.Name) else None
    return None


def _fields(path: Path, name: str, seen: set[tuple[Path, str]]) -> set[str]:
    """The field names of the dataclass `name` in `path` (or imported there): its annotated
    names and its bases'; an assignment's, those `_assigned` reads."""
    if (path, name) in seen:
        return set()
    seen.add((path, name))
    tree = _tree(path)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            own = {
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            }
            bases = (b.id for b in node.bases if isinstance(b, ast.Name))
            return own.union(*(_fields(path, b, seen) for b in bases))
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return _assigned(path, node.value, seen)
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            real = next((a.name for a in node.names if (a.asname or a.name) == name), None)
            source = ROOT / (node.module.replace(".", "/") + ".py")
            if real is not None:
                return _fields(source, real, seen) if source.is_file() else set()
    return set()


def _assigned(path: Path, value: ast.expr, seen: set[tuple[Path, str]]) -> set[str]:
    """The fields an assignment's `value` lists: a `make_dataclass(NAME, FIELDS, bases=...)`'s
    FIELDS and bases; a comprehension's, those of what it iterates less the names its
    `if not f.name.startswith("disk_")` leaves out; else those of each class it names."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "make_dataclass":
        bases = [k.value for k in value.keywords if k.arg == "bases"]
        parts = [*value.args[1:2], *bases]
        return set().union(*(_assigned(path, part, seen) for part in parts))
    if isinstance(value, ast.ListComp | ast.GeneratorExp):
        found = set().union(*(_named(path, g.iter, seen) for g in value.generators))
        return {f for f in found if not f.startswith(_left_out(value))}
    return _named(path, value, seen)


def _named(path: Path, node: ast.expr, seen: set[tuple[Path, str]]) -> set[str]:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
    return set().union(*(_fields(path, n, seen) for n in names))


def _left_out(comp: ast.ListComp | ast.GeneratorExp) -> tuple[str, ...]:
    """The prefixes of `if not X.startswith("P")` conditions of a comprehension."""
    left: list[str] = []
    for cond in (c for g in comp.generators for c in g.ifs):
        call = cond.operand if isinstance(cond, ast.UnaryOp) else None
        if (
            isinstance(cond, ast.UnaryOp)
            and isinstance(cond.op, ast.Not)
            and isinstance(call, ast.Call)
            and isinstance(call.func, ast.Attribute)
            and call.func.attr == "startswith"
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, str)
        ):
            left.append(call.args[0].value)
    return tuple(left)
