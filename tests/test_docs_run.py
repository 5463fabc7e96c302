"""The code the README and docs/ show a newcomer runs as written (issue 48, round 25d): the
command lines parse (tests/test_docs_commands.py); here, what they show beside them.

- Each fenced python block compiles, and the project functions it calls without defining them
  (the command skeleton's `command`, `until_interrupted`, `exit_command`) are there.
- Each `from X import Y` of a python block or a documented `python -c '...'` names a module
  of the project and a name it defines.
- Each call of a project function or class in inline code (`kv(opts)`,
  `Klotski(KlotskiParams(n=0)).choose`, `new_copies(..., one_queue=True)`) binds to its
  signature: keywords it takes, no more positional arguments than it has (`...` stands for any).
- The Planner protocol architecture.md shows is core.planner's.
- An error line the docs quote is the one the command prints (QUOTED), run in this process.

Read from the sources with `ast`, not imported, to keep it cheap; the newcomer's chain of
full runs (README's one run, then trace_json on it) is in the slow suite.
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from tests.probes.conftest import TINY, cli, one_line
from tests.test_docs_commands import FENCE, PAGES, ROOT

PACKAGES = ("core", "planners", "sim", "real", "experiments")
INLINE_CALL = re.compile(r"`([A-Za-z_]\w*\([^`]*\)[\w.]*)`")
PYTHON_C = re.compile(r"python -c '([^']*)'")


def _where(page: Path, text: str, at: int) -> str:
    return f"{page.relative_to(ROOT)}:{text[:at].count(chr(10)) + 1}"


def _python_blocks() -> list[tuple[str, str]]:
    """(page:line, source) of each fenced python block and each `python -c '...'` snippet."""
    out = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == "python":
                lines = m.group(2).splitlines()
                indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
                out.append((_where(page, text, m.start()), "\n".join(x[indent:] for x in lines)))
        out += [(_where(page, text, m.start()), m.group(1)) for m in PYTHON_C.finditer(text)]
    return out


@functools.cache
def _sources() -> dict[str, str]:
    """Each module of the packages' source, by its dotted name."""
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts): path.read_text()
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
    }


@functools.cache
def _defined(name: str) -> list[tuple[str, ast.AST]]:
    """(module, node) of each top-level function or class `name` of the packages: the modules
    whose text defines it parsed, not every module (seconds of CPU)."""
    found: list[tuple[str, ast.AST]] = []
    pattern = re.compile(rf"^(?:async def|def|class) {re.escape(name)}\b", re.M)
    for module, source in _sources().items():
        if pattern.search(source):
            found += [
                (module, n)
                for n in _tree(module).body
                if isinstance(n, ast.FunctionDef | ast.ClassDef) and n.name == name
            ]
    return found


@functools.cache
def _tree(module: str) -> ast.Module:
    return ast.parse(_sources()[module])


def _params(node: ast.AST) -> tuple[list[str], bool, bool] | None:
    """(parameter names, takes *args, takes **kwargs) a call of `node` binds to; None where
    that is not read from the source (a class without __init__ that is not a dataclass)."""
    if isinstance(node, ast.ClassDef):
        init = next((n for n in node.body if getattr(n, "name", "") == "__init__"), None)
        if isinstance(init, ast.FunctionDef):
            names, star, stars = _params(init) or ([], False, False)
            return names[1:], star, stars
        decorators = [ast.unparse(d) for d in node.decorator_list]
        if not any(d.split("(")[0].endswith("dataclass") for d in decorators):
            return None
        fields = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
        return [f for f in fields if isinstance(f, str)], False, False
    assert isinstance(node, ast.FunctionDef)
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    return names, a.vararg is not None, a.kwarg is not None


def _binds(call: ast.Call, node: ast.AST) -> bool:
    params = _params(node)
    if params is None:
        return True
    names, star, stars = params
    given = [a for a in call.args if not (isinstance(a, ast.Constant) and a.value is ...)]
    if len(given) < len(call.args):  # `...`: any positional arguments
        star = True
    if not star and len(given) > len([n for n in names if n != "self"]):
        return False
    return stars or all(k.arg is None or k.arg in names for k in call.keywords)


def _inline_calls() -> list[tuple[str, str, ast.Call]]:
    """(page:line, code, call) of each call of a project name in inline code."""
    out = []
    for page in PAGES:
        text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
        for m in INLINE_CALL.finditer(text):
            try:
                tree = ast.parse(m.group(1).replace("\n", " "), mode="eval")
            except SyntaxError:
                continue  # prose in backquotes (`max(flops / peak, ...)` reads as a formula)
            for call in ast.walk(tree):
                named = isinstance(call, ast.Call) and isinstance(call.func, ast.Name)
                if named and _defined(call.func.id):
                    out.append((_where(page, text, m.start()), m.group(1), call))
    return out


def test_each_python_block_compiles_and_its_names_are_there() -> None:
    problems = []
    for where, source in _python_blocks():
        try:
            tree = ast.parse(source)
        except SyntaxError as e:
            problems.append(f"{where}: does not compile: {e}")
            continue
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        defined |= {
            n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
        }
        defined |= {
            a.asname or a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom)
            for a in n.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                for alias in node.names:
                    modules = [m for m, _ in _defined(alias.name)]
                    if node.module not in modules:
                        problems.append(f"{where}: {node.module} defines no {alias.name}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                name = node.func.id
                if name not in defined | set(dir(builtins)) and not _defined(name):
                    problems.append(f"{where}: calls {name}, which the project lacks")
    assert not problems, "\n".join(problems)


def test_the_skeleton_calls_what_experiments_common_has() -> None:
    """The command skeleton of docs/commands.md calls `command`, `until_interrupted` and
    `exit_command` from experiments.common, as every command does."""
    skeleton = next(s for w, s in _python_blocks() if "_app = command(" in s)
    called = {
        n.func.id
        for n in ast.walk(ast.parse(skeleton))
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    names = {"command", "until_interrupted", "exit_command"}
    common = {n for n in names if any(m.startswith("experiments.common.") for m, _ in _defined(n))}
    assert names <= called & common, (called, common)


def test_each_inline_call_binds_to_its_signature() -> None:
    calls = _inline_calls()
    assert len(calls) >= 8  # the reader finds them (`kv(opts)`, `check_keys(...)`, ...)
    wrong = []
    for where, code, call in calls:
        name = call.func.id
        defs = _defined(name)
        if not any(_binds(call, node) for _, node in defs):
            owners = " or ".join(m for m, _ in defs)
            wrong.append(f"{where}: `{code}`: {owners}.{name} takes no such arguments")
    assert not wrong, "\n".join(wrong)


def test_architecture_shows_the_planner_protocol_as_it_is() -> None:
    from core.planner import Planner

    block = next(s for w, s in _python_blocks() if "class Planner(Protocol)" in s)
    shown = re.search(r"def plan(\(.*\)) -> None", block)
    assert shown, block
    assert shown.group(1).replace("'", "") == str(inspect.signature(Planner.plan)).split(" ->")[
        0
    ].replace("'", "")


# (what the docs quote, a line of theirs, the command, its arguments, what its line says)
QUOTED: list[tuple[str, str, list[str], str]] = [
    (
        "`planner.params.KEY must be a finite\nnumber, got inf`",
        "experiments.run",
        [
            "model=tiny",
            "hardware=h200-hgx8",
            "workload=tiny",
            "planner=eplb",
            "planner.params.interval=inf",
        ],
        "planner.params.interval must be a finite number, got inf; "
        "pass planner.params.interval=<an integer>",
    ),
    (
        "a param of floats: `planner NAME: `\nfirst",
        "experiments.run",
        [*TINY[:3], "planner=fiddler", "planner.params.resident_share=inf"],
        "planner fiddler: planner.params.resident_share must be a finite number, got inf",
    ),
]


@pytest.mark.parametrize("quote, module, args, said", QUOTED, ids=lambda x: str(x)[:30])
def test_a_quoted_error_line_is_the_one_printed(
    cli_here: Any, quote: str, module: str, args: list[str], said: str
) -> None:
    docs = "\n".join(p.read_text() for p in PAGES)
    assert quote in docs, f"the docs no longer quote {quote!r}: drop or update its case"
    one_line(cli_here(module, *args), said)


def test_the_documented_dense_layers_example_holds() -> None:
    """make_checkpoint's `moe_layers=[0,2]`, shown alone, was refused on the page's own
    mixtral-tiny (a dense layer needs `dense_ffn_size`, and a Mixtral config.json has none):
    the page gives the whole example and the families that take it."""
    from core.errors import ConfigError
    from core.hf_config.from_spec import spec_to_hf_config
    from real.checkpoint import reduced_spec

    text = (ROOT / "docs" / "commands.md").read_text()
    shown = "`n_layers=3 moe_layers=[0,2]\ndense_ffn_size=128`"
    assert shown in text, "commands.md's make_checkpoint no longer shows the example"
    dense = {"n_layers": 3, "moe_layers": [0, 2], "dense_ffn_size": 128}
    assert spec_to_hf_config(reduced_spec("qwen1.5-moe-a2.7b", **dense))["num_hidden_layers"] == 3
    first = reduced_spec("deepseek-v2-lite", **{**dense, "moe_layers": [1, 2]})
    assert spec_to_hf_config(first)["first_k_dense_replace"] == 1
    with pytest.raises(ConfigError, match="cannot express dense layers"):
        spec_to_hf_config(reduced_spec("mixtral-tiny", **dense))


@pytest.mark.slow
def test_the_readme_one_run_then_its_trace_json(tmp_path: Path) -> None:
    """README's one run as written (into a folder of the test's), then the line after it."""
    text = (ROOT / "README.md").read_text()
    run = re.search(r"## One run\n\n```bash\n(.*?)```", text, re.S)
    assert run, "README.md has no One run block"
    words = run.group(1).replace("\\\n", " ").split()
    assert words[:3] == ["python", "-m", "experiments.run"], words
    r = cli("experiments.run", *words[3:], f"hydra.run.dir={tmp_path}/run")
    assert r.returncode == 0, r.stderr
    for name in ("config.yaml", "trace.parquet", "summary.json"):
        assert name in text and (tmp_path / "run" / name).is_file(), name
    assert "python -m experiments.trace_json runs=RUN_DIR" in text
    r = cli("experiments.trace_json", f"runs={tmp_path}/run")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "run" / "trace.json").is_file()
