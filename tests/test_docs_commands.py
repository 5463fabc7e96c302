"""Every `python -m experiments...` command line in the README and docs/ still parses: its module
is a moepipe command, and each `key=value` passes the checks the command makes before it runs
(`experiments.common.app`: its argv checks, then hydra's composition against its schema), made
here in-process without running it. A renamed option or module fails here, not for a newcomer.

Read from code blocks (fenced bash, sh or unlabelled ones, and indented ones; `\\` continuations
joined, `for VAR in ...; do` loops expanded) and from inline code. The rule for what a reader
fills in (docs/commands.md): a value, or an item of a list value, in capitals (`DIR`, `RUN_DIR`,
`FILE.yaml`, `N`), one with `<name>` in it, or `...`, is a placeholder, and only its key is
checked; `[key=value]` is an optional option, checked as given; everything else is literal. A
command written with the commit it ran at right after it (`` `python -m ...` at d320e94 ``) is a
record of that run, left unchecked. A hardware profile a documented calibrate writes
(`hardware.name=NAME`) counts as a placeholder where a run names it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import shlex
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from experiments.common import app, hydra_errors
from experiments.common.argv_checks import (
    key_given_twice,
    missing_launcher,
    sweep_experiment_misused,
)
from experiments.common.schema import RunSchema
from experiments.run import misplaced_output

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)
SHELL = ("", "bash", "sh", "console")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*(\.ya?ml)?|.*<\w+>.*|\.\.\.")
INDENTED = re.compile(r"(?<=\n\n)((?:    .*\n)+)")  # a block indented 4 spaces after a blank line
LOOP = re.compile(r"for (\w+) in ([^;]+); do\n(.*?)\ndone", re.S)
RECORD = re.compile(r"\)?,? *\n? *at (commit )?[0-9a-f]{7,40}\b")  # `...` at d320e94: ran then
RUN_FILE_GROUPS = ("hardware", "model", "workload")  # experiments.run's FILE.yaml groups


@dataclass(frozen=True)
class DocCommand:
    where: str  # page:line
    module: str  # experiments.X
    args: tuple[str, ...]  # as the shell passes them

    @property
    def line(self) -> str:
        return shlex.join(["python", "-m", self.module, *self.args])


def _spans(page: Path) -> Iterator[tuple[int, str]]:
    """(line number, shell text) of each shell block's lines, fenced or indented, and of each
    inline code span."""
    text = page.read_text()
    for m in FENCE.finditer(text):
        if m.group(1) in SHELL:
            yield from _block(m.group(2), text[: m.start()].count("\n") + 2)
    rest = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for m in INDENTED.finditer(rest):
        yield from _block(m.group(1), rest[: m.start(1)].count("\n") + 1)
    rest = INDENTED.sub(lambda m: "\n" * m.group(0).count("\n"), rest)
    for m in re.finditer(r"`([^`]+)`", rest):
        if not RECORD.match(rest, m.end()):
            yield rest[: m.start()].count("\n") + 1, m.group(1).replace("\n", " ")


def _block(body: str, first: int) -> Iterator[tuple[int, str]]:
    """A code block's lines from line `first` on, a `\\`-continued one joined to the next."""
    lines, i = LOOP.sub(_expand, body).split("\n"), 0
    while i < len(lines):
        start, line = i, lines[i]
        while line.rstrip().endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line.rstrip()[:-1] + " " + lines[i]
        inline = re.findall(r"`([^`]+)`", line)  # a layout block's inline code
        yield from ((first + start, s) for s in (inline or [line]))
        i += 1


def _expand(loop: re.Match[str]) -> str:
    """A `for` loop as its body once per value, on as many lines as the loop took."""
    var, values, body = loop.group(1), loop.group(2).replace("\\\n", " ").split(), loop.group(3)
    body = body.replace("\\\n", " ").strip()
    lines = [re.sub(rf"\$\{{?{var}\}}?", v, body) for v in values]
    return "; ".join(lines) + "\n" * loop.group(0).count("\n")


def doc_commands() -> list[DocCommand]:
    """Every documented `-m experiments.X ...` command, once per distinct line."""
    out: dict[str, DocCommand] = {}
    for page in PAGES:
        where = page.relative_to(ROOT)
        for number, span in _spans(page):
            for part in re.split(r"&&|;|\|\|?", span):
                if not re.search(r"-m experiments\b", part):
                    continue
                words = shlex.split(part, comments=True)
                i = next(i for i, w in enumerate(words) if w.startswith("experiments"))
                if words[i] == "experiments.torchrun":  # torchrun's args, then the run's
                    if "experiments.run" not in words[i:]:
                        continue
                    i = words.index("experiments.run", i)
                cmd = DocCommand(f"{where}:{number}", words[i], tuple(words[i + 1 :]))
                out.setdefault(cmd.line, cmd)
    return list(out.values())


COMMANDS = doc_commands()


def _is_placeholder(value: str) -> bool:
    items = value.strip("[]").split(",") if value.startswith("[") else [value]
    return any(PLACEHOLDER.fullmatch(item.strip()) for item in items)


def _calibrated_profiles() -> set[str]:
    """The hardware profile names the documented calibrate commands write."""
    names = {"this-machine"}  # calibrate's default hardware.name
    for cmd in COMMANDS:
        if cmd.module == "experiments.calibrate":
            names |= {a.partition("=")[2] for a in cmd.args if a.startswith("hardware.name=")}
    return names


def _command_config(module: str) -> tuple[Path, str, type, list[str], tuple[str, ...]]:
    """(config folder, config name, options schema, hydra's own args, FILE.yaml groups) of the
    command `module`, as its `main` passes them to `app.hydra_main`."""
    name = module.removeprefix("experiments.").replace(".", "_")
    if name == "run":
        return app.CONF_DIR, "config", RunSchema, ["hydra.job.name=run"], RUN_FILE_GROUPS
    assert (app.COMMAND_DIR / f"{name}.yaml").is_file(), f"no conf/command/{name}.yaml"
    node = ConfigStore.instance().repo[f"{name}_schema.yaml"].node
    schema = OmegaConf.get_type(node)
    assert isinstance(schema, type)
    return app.COMMAND_DIR, name, schema, [*app.PLAIN, f"hydra.job.name={name}"], ()


def _key_known(cfg: Any, conf_dir: Path, key: str) -> bool:
    """Whether `key` (of a placeholder value) is a config group or a key of `cfg`."""
    key = key.lstrip("+~")
    if (conf_dir / key).is_dir() or key.startswith("hydra/"):
        return True
    parent, _, last = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return isinstance(node, DictConfig) and last in list(node)  # `in` misses a ??? value


def check(cmd: DocCommand) -> None:
    """The checks `cmd`'s own `main` makes before it runs anything; AssertionError or the
    command's own error (MoepipeError, a hydra error) where one fails."""
    if re.search(r"\.([A-Z]+|<\w+>)$", cmd.module):  # `experiments.bench.NAME`: a family
        package = cmd.module.rsplit(".", 1)[0]
        assert importlib.util.find_spec(package) is not None, f"no package {package}"
        return
    assert importlib.util.find_spec(cmd.module) is not None, f"no module {cmd.module}"
    module = importlib.import_module(cmd.module)
    assert callable(getattr(module, "main", None)), f"{cmd.module} is not a command (no main)"
    conf_dir, config, schema, hydra_args, file_groups = _command_config(cmd.module)
    args = [a[1:-1] if re.fullmatch(r"\[\w[\w.]*=.*\]", a) else a for a in cmd.args]
    profiles = _calibrated_profiles() if config == "config" else set()
    open_keys, given = [], []
    for a in args:
        key, sep, value = a.partition("=")
        placeholder = sep and (_is_placeholder(value) or (key == "hardware" and value in profiles))
        (open_keys if placeholder else given).append(key if placeholder else a)
    assert all(a.startswith("-") or "=" in a for a in given), f"not key=value: {given}"
    assert (twice := key_given_twice(args)) is None, twice
    if config == "config":
        problem = sweep_experiment_misused(args) or missing_launcher(args) or misplaced_output(args)
        assert problem is None, problem
    else:
        assert "-m" not in given, f"{config} runs once, not as a sweep"
    app.running(schema)
    given = [app.as_list(a, app.list_options(schema)) for a in given]
    tmp = Path(tempfile.mkdtemp(prefix="moepipe-doc-"))
    try:
        given, added = app.group_files(given, file_groups, tmp, {})
        given = app.with_search_path(given, [tmp] if added else [])
        flags, overrides = app._checked_args(given, conf_dir, config, file_groups)
        if "-m" not in flags:  # a sweep's points were composed by _checked_args
            with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
                compose(config, [*hydra_args, *overrides], return_hydra_config=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = _composed(conf_dir, config, tuple(hydra_args)) if open_keys else None
    unknown = [k for k in open_keys if not _key_known(base, conf_dir, k)]
    assert not unknown, f"unknown keys given placeholders: {unknown}"


@functools.cache
def _composed(conf_dir: Path, config: str, hydra_args: tuple[str, ...]) -> DictConfig:
    """The command's config at its defaults, with hydra's (where a placeholder's key is looked
    up)."""
    with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3"):
        return compose(config, list(hydra_args), return_hydra_config=True)


@pytest.fixture(autouse=True)
def _root_schema() -> Iterator[None]:
    saved = list(hydra_errors.ROOT_SCHEMA)
    yield
    hydra_errors.ROOT_SCHEMA[:] = saved


def _params(commands: list[DocCommand]) -> list[Any]:
    """Each command once; the second and later values of a documented `for` loop (the same line,
    another value: each composes its whole sweep, seconds apiece) run in the slow suite."""
    seen: set[tuple[str, str]] = set()
    out = []
    for c in commands:
        again = (c.where, c.module) in seen
        seen.add((c.where, c.module))
        out.append(pytest.param(c, marks=pytest.mark.slow) if again else c)
    return out


@pytest.mark.parametrize("cmd", _params(COMMANDS), ids=lambda c: f"{c.where} {c.module}")
def test_documented_command_parses(cmd: DocCommand) -> None:
    try:
        check(cmd)
    except Exception as e:
        pytest.fail(f"{cmd.where}: {cmd.line}\n  {type(e).__name__}: {e}")


def test_docs_hold_commands() -> None:
    """The reader finds the documented commands (a change to the markdown that hides them from
    it would pass every other test here)."""
    modules = {c.module for c in COMMANDS}
    assert len(COMMANDS) >= 80 and {"experiments.run", "experiments.bench.sim"} <= modules


def test_readme_first_screen() -> None:
    """The README's first code block is the two set-up commands: install and run the main job,
    install and run the tests; the second is what .ci/run calls."""
    block = FENCE.search((ROOT / "README.md").read_text())
    assert block is not None
    lines = [x for x in block.group(2).splitlines() if x.strip() and not x.startswith("#")]
    assert lines == [
        "pip install -e . && python -m experiments.run -m experiment=compare",
        'pip install -e ".[dev]" && python -m pytest',
    ]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert lines[1] in ci, ".ci/run does not call the README's test command"
