"""The docs name what the code has, each check failing with what to add:

- docs/architecture.md's module map places every package, module, conf/ group and test helper
  (and names nothing gone), each placed module has a docstring, and its schedule IR section
  names every `Op` field, op kind and resource;
- docs/commands.md documents every option each command's schema takes (read from the sources
  by experiments.common.command_options, as a refused key's line names them) and every run key
  of the executor, workload, routing and replication groups; its summary.json table has a row
  for every key a reader of this version reads; both pages name every trace column;
- the README's Commands table has a row for every command module;
- every `core.*` / `sim.*` / `real.*` / `planners.*` / `experiments.*` name the README and
  docs/*.md cite is there.

Links and anchors: tests/test_docs_links.py; documented command lines: test_docs_commands.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.schedule import Op
from core.trace_check import TRACE_COLUMNS
from core.types import OpKind, Resource
from experiments.common import command_options, summary_keys, tables

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("core", "sim", "real", "planners", "experiments")
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def _section(page: Path, heading: str) -> str:
    """The text of `page` under `heading` (a `## ` line), up to the next heading of that level."""
    text = page.read_text()
    m = re.search(rf"^{re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"{page.relative_to(ROOT)} has no '{heading}' section"
    return m.group(1)


def _code_modules() -> set[str]:
    """Every module of the packages, and the tests' helper modules (not test_*.py, not an empty
    package marker), as paths from the repository root."""
    found = {p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    found |= {
        p
        for p in (ROOT / "tests").rglob("*.py")
        if not p.name.startswith("test_") and p.name != "__init__.py"
    }
    return {p.relative_to(ROOT).as_posix() for p in found if "__pycache__" not in p.parts}


def _conf_groups() -> set[str]:
    return {f"conf/{p.name}/" for p in (ROOT / "conf").iterdir() if p.is_dir()}


def _mapped() -> set[str]:
    """The paths the module map places: each entry's first inline code, `- `path`: ...`."""
    return set(re.findall(r"^- `([\w/.]+)`:", _section(ARCHITECTURE, "## Module map"), re.M))


def test_module_map_places_every_module() -> None:
    missing = sorted((_code_modules() | _conf_groups()) - _mapped())
    assert not missing, (
        "docs/architecture.md's Module map lacks (add `- `PATH`: one-line purpose`): "
        + ", ".join(missing)
    )


def test_module_map_names_nothing_gone() -> None:
    gone = sorted(p for p in _mapped() if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's Module map names what no longer exists: {gone}"


def _has_docstring(path: Path) -> bool:
    """Whether the module's first statement is a string (comment lines before it allowed)."""
    lines = [x for x in path.read_text().splitlines() if x.strip() and not x.startswith("#")]
    return bool(lines) and re.match(r'[rbuRBU]?("""|\'\'\'|"|\')', lines[0]) is not None


def test_placed_modules_have_docstrings() -> None:
    bare = sorted(m for m in _code_modules() if not _has_docstring(ROOT / m))
    assert not bare, f"these modules say nothing of what they are (add a docstring): {bare}"


COMMANDS = ROOT / "docs" / "commands.md"


def _command_sections() -> dict[str, str]:
    """docs/commands.md's `### name` sections (their `####` parts included), by name."""
    text = COMMANDS.read_text()
    found = re.finditer(r"^### (\w+)\n(.*?)(?=^#{2,3} |\Z)", text, re.S | re.M)
    return {m.group(1): m.group(2) for m in found}


def _documented(key: str, text: str) -> bool:
    """Whether `text` documents option `key`: `key=...` anywhere, or `key` as a word (not a
    dotted key's tail) in inline code."""
    word = rf"(?<![\w.]){re.escape(key)}"
    return bool(re.search(word + "=", text) or re.search(rf"`[^`\n]*{word}\b[^`\n]*`", text))


def _undocumented() -> dict[str, list[str]]:
    """Each command -> the options its schema takes that its section never names. make_checkpoint
    takes every ModelSpec field, documented as a rule; its own options are checked one by one."""
    sections = _command_sections()
    out = {}
    for module, names in command_options._options().items():
        name = module.removeprefix("experiments.").replace(".", "_")
        text = sections.get(name, "")
        if name == "make_checkpoint":
            assert "any `ModelSpec` field" in text, "make_checkpoint's ModelSpec rule is gone"
            names = frozenset(
                command_options._fields(
                    ROOT / "experiments" / "make_checkpoint.py", "Options", set()
                )
            )
        out[module] = sorted(k for k in names if not _documented(k, text))
    return out


def test_commands_md_documents_every_option() -> None:
    missing = {m: keys for m, keys in _undocumented().items() if keys}
    assert not missing, "docs/commands.md lacks these options (name each in its command's " + (
        "section, `key` or `key=...`): "
        + "; ".join(f"{m}: {', '.join(keys)}" for m, keys in missing.items())
    )


def _summary_keys() -> list[str]:
    """The summary.json keys a reader of this version reads, as the table names them: a
    top-level key, `group.<name>` for a mapping of name -> number, `plan.key` for the plan's."""
    top = [*tables.TEXTS, *tables.MAPPINGS, *tables.METRICS, *tables.PER_LAYER_MAPS, "status"]
    groups = [f"{g}.<" for g in tables.METRIC_GROUPS]
    plan = [f"plan.{k}" for k in summary_keys.PLAN_KEYS]
    return [*top, *groups, *plan, *tables.PER_LAYER_LISTS]


def test_commands_md_describes_every_summary_key() -> None:
    table = _command_sections()["run"].partition("#### summary.json keys")[2]
    assert table, "docs/commands.md's run section has no '#### summary.json keys' table"
    rows = re.findall(r"^\| (.*?) \| .*\|$", table, re.M)
    named = " ".join(rows)
    missing = []
    for key in _summary_keys():
        head, _, tail = key.rpartition(".") if key.startswith("plan.") else ("", "", key)
        if key.endswith(".<"):
            found = f"`{key}" in named
        elif head.count(".") >= 1:  # plan.placement.dense: `plan.placement` (`.dense`, ...)
            found = f"`{head}`" in named and f"`.{tail}`" in named
        else:
            found = f"`{key}`" in named
        if not found:
            missing.append(key)
    assert not missing, f"docs/commands.md's summary.json keys table lacks rows for: {missing}"


@pytest.mark.parametrize("page", ["docs/architecture.md", "docs/commands.md"])
def test_docs_name_every_trace_column(page: str) -> None:
    """A trace.parquet's columns (core.trace_check.TRACE_COLUMNS), each named where the page
    lists them."""
    text = (ROOT / page).read_text()
    missing = [c for c in TRACE_COLUMNS if f"`{c}`" not in text]
    assert not missing, f"{page} does not name trace column(s) {missing}"


def test_every_command_is_in_readme_and_commands_md() -> None:
    """Each command module (experiments/ and experiments/bench/, one module each) has a row in
    the README's Commands table and is shown run in docs/commands.md."""
    readme = (ROOT / "README.md").read_text().partition("## Commands")[2].partition("\n## ")[0]
    commands = COMMANDS.read_text()
    missing = []
    for path in [*(ROOT / "experiments").glob("*.py"), *(ROOT / "experiments/bench").glob("*.py")]:
        if path.name == "__init__.py":
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        line = f"`python -m {module}"
        missing += [f"README.md: {module}"] * (line not in readme)
        missing += [f"docs/commands.md: {module}"] * (f"python -m {module}" not in commands)
    assert not missing, f"no row or section names these commands: {missing}"


def test_architecture_names_the_ir() -> None:
    """The schedule IR section names every `Op` field, op kind and resource."""
    ir = _section(ARCHITECTURE, "## The schedule IR")
    names = [*Op._fields, *(k.value for k in OpKind)]
    missing = [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", ir)]
    missing += [r.value for r in Resource if f"`{r.value}`" not in ir]
    assert not missing, f"docs/architecture.md's schedule IR section does not name: {missing}"


# experiments.run's groups whose keys are its options beyond conf/'s files (a model's and a
# hardware's fields are their YAMLs', documented there, each with its source)
RUN_GROUPS = {
    "executor": "ExecutorSchema",
    "workload": "WorkloadSchema",
    "workload.routing": "RoutingSchema",
    "replication": "ReplicationSchema",
}


def test_commands_md_documents_every_run_key() -> None:
    run = _command_sections()["run"]
    text = COMMANDS.read_text()
    schema = ROOT / "experiments" / "common" / "schema.py"
    missing = [
        f"{group}.{key}"
        for group, cls in RUN_GROUPS.items()
        for key in sorted(command_options._fields(schema, cls, set()))
        if f"{group}.{key}" not in text and f"`{key}`" not in run
    ]
    assert not missing, f"docs/commands.md does not name experiments.run's keys: {missing}"


# `core.x.name`, `real.x.name`, ...: a dotted name of the code, as the docs cite one
DOTTED = re.compile(r"`((?:core|sim|real|planners|experiments)(?:\.\w+)+)`")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # not results/: records


def _cited_missing(name: str) -> bool:
    """Whether `name` (`pkg.module.attr...`) names no module, or its first part past the
    module is not a word of that module's source; a placeholder part (`NAME`) is not checked."""
    parts = name.split(".")
    if any(p.isupper() for p in parts):
        return False
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        source = (
            base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        )
        if source.is_file():
            rest = parts[i:]
            return bool(rest) and not re.search(rf"\b{rest[0]}\b", source.read_text())
    return True


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_cited_code_names_exist(page: Path) -> None:
    gone = sorted({n for n in DOTTED.findall(page.read_text()) if _cited_missing(n)})
    assert not gone, f"{page.relative_to(ROOT)} cites code that is not there: {gone}"
