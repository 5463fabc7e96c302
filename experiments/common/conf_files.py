"""The YAML files of a user's config folders (`--config-dir`, `hydra.searchpath=[file://...]`),
checked before hydra reads them: hydra's loader raised a UnicodeDecodeError on one not UTF-8,
a RecursionError on one nested thousands deep or whose defaults list names itself, a ValueError
on defaults that are no list, and built a "billion laughs" for minutes. Each is one line naming
the file; a group's option that is a folder, not a file, is named as one, and so is a file that
the shipped conf/ has under the same name (hydra reads conf/'s first: the user's, never).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import typing
from collections.abc import Iterator, Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml

from core.errors import MoepipeError
from core.files import no_file_words, not_regular, read_small
from core.yaml_size import check_yaml_size
from experiments.common.path_values import CONTROL, CONTROL_NAMES

_SUFFIXES = (".yaml", ".yml")
_MAX_FILES = 2000  # a config folder holds tens; `--config-dir /` is not walked past this


def check_conf_dirs(dirs: Sequence[Path], overrides: Sequence[str], shipped: Path) -> None:
    """Each YAML file in `dirs` (the top and two levels of group folders) is a readable config
    file whose defaults are a list that does not loop, and not one the `shipped` config folder
    has under its name; a `group=name` of `overrides` whose name is a folder there says so."""
    for d in dirs:
        if not d.is_dir():
            continue  # the flag's own check names it
        links = {}  # config (group/name) -> the configs its defaults list names
        for path in _yaml_paths(d):
            links[path.relative_to(d).with_suffix("").as_posix()] = _check_file(d, path)
            _not_shadowed(path, path.relative_to(d), shipped)
        _check_loops(d, links)
        for o in overrides:
            group, eq, typed = o.lstrip("+").partition("=")
            name = unquoted(typed)  # `model='afold'` names afold as hydra reads it
            folder = d / group / name
            is_file = any((d / group / f"{name}{s}").exists() for s in _SUFFIXES)
            if eq and name and "/" not in name and folder.is_dir() and not is_file:
                raise MoepipeError(
                    f"{o}: {folder} is a folder; an option of {group} is a file {name}.yaml "
                    f"in {d / group}: write it there, or rename the folder"
                )


def _not_shadowed(path: Path, rel: Path, shipped: Path) -> None:
    """A MoepipeError where the `shipped` config folder has the user's `path` (`rel` in its own
    folder) under its name, unless both hold the same text: hydra finds the shipped one first,
    and the user's edits to a copy of it (`model/tiny.yaml`, the command's own `config.yaml`)
    were run without a word, unread."""
    theirs = shipped / rel
    try:
        if path.resolve() == theirs.resolve() or path.read_bytes() == theirs.read_bytes():
            return
    except OSError:  # conf/ has none of that name (or the user's is checked by _check_file)
        return
    other = f"pass {rel.parts[0]}=<that name>" if len(rel.parts) > 1 else "pass --config-name"
    raise MoepipeError(
        f"{path}: {theirs} has its name and is read first, so this file would never be read; "
        f"give it a name of its own (and {other}), or leave the shipped config's name to it"
    )


def _yaml_paths(d: Path) -> Iterator[Path]:
    seen = 0
    for root, dirs, files in os.walk(d):
        depth = len(Path(root).relative_to(d).parts)
        dirs[:] = [x for x in sorted(dirs) if not x.startswith(".") and depth < 2]
        for name in (*files, *dirs):  # a folder named x.yaml is in `dirs`
            if name.endswith(_SUFFIXES):
                seen += 1
                if seen > _MAX_FILES:
                    return
                yield Path(root) / name


def _check_file(d: Path, path: Path) -> list[str]:
    """`path` checked as a config file; the configs (group/name) its defaults list names."""
    fix = "fix that file or move it out of the config folder"
    if not path.is_file():
        what = no_file_words(path.stat().st_mode) if path.exists() else "a link to nothing"
        raise MoepipeError(f"{path}: {what}; a config is a YAML file: move it out of {d}")
    try:
        text = read_small(path, fix=fix).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MoepipeError(f"{path}: not UTF-8 text (byte {e.start}); {fix}") from None
    except OSError as e:
        raise MoepipeError(f"{path}: cannot read it ({e.strerror or e}); {fix}") from None
    check_yaml_size(text, str(path), fix)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return []  # hydra's own line names its line
    group = path.relative_to(d).parent.as_posix().strip(".")
    wrong = not_fields(data, group.split("/")[-1]) or control_in(data)
    if wrong:
        raise MoepipeError(f"{path}: {wrong}")
    if not isinstance(data, dict) or "defaults" not in data:
        return []
    defaults = data["defaults"]
    if not isinstance(defaults, list):
        raise MoepipeError(
            f"{path}: defaults is {type(defaults).__name__}, not a list of configs; {fix}"
        )
    return [_target(group, e) for e in defaults if isinstance(e, str) and e != "_self_"]


def control_in(data: Any, key: str = "") -> str | None:
    """What a YAML value (or key) of `data` holding a control character says (a newline in a
    quoted `name: "a\\nb"`, a tab): the field, which character, and the line to write instead
    (as overrides' `path_values.control_line`); None where none holds one. No field takes one:
    hydra took it, and it reached a run folder's name or a lookup. A hardware file's `sources`
    (notes, free text) may."""
    items = data.items() if isinstance(data, dict) else enumerate(data or ())
    if isinstance(data, str | bytes):
        items = iter(())
    for k, v in items:
        at = f"{key}[{k}]" if isinstance(k, int) else f"{key}.{k}".lstrip(".")
        if isinstance(k, str) and CONTROL.search(k):
            return _control_said(at, k, "key")
        if isinstance(v, str) and CONTROL.search(v) and not at.startswith("sources."):
            return _control_said(at, v, "value")
        if isinstance(v, dict | list) and at != "sources":
            said = control_in(v, at)
            if said:
                return said
    return None


def _control_said(at: str, text: str, what: str) -> str:
    char = CONTROL.search(text).group()  # type: ignore[union-attr]
    name = CONTROL_NAMES.get(char, f"a control character ({char!r})")
    fixed = CONTROL.sub("", text)
    line = fixed if what == "key" else f"{at.rsplit('.', 1)[-1]}: {json.dumps(fixed)}"
    return (
        f"{at}: its {what} {json.dumps(text)} holds {name}, which no field takes; write it "
        f"on one line: {line}"
    )


def not_fields(data: Any, group: str) -> str | None:
    """What a config of `group` holds where a mapping of its fields belongs (a scalar, a list:
    hydra read `tiny` as an unknown key `tiny`), and what it should hold; None for a mapping or
    an empty file."""
    if data is None or isinstance(data, dict):
        return None
    from experiments.common.schema import RunSchema

    kind = type(data).__name__
    what = (
        f"a list of {len(data)}"
        if isinstance(data, list)
        else f"a{'n' * (kind[0] in 'aeiou')} {kind}"
    )
    shown = "" if isinstance(data, list) else f" {repr(data)[:40]}"
    schema = typing.get_type_hints(RunSchema).get(group)
    names = [f.name for f in fields(schema)][:3] if is_dataclass(schema) else []
    them = f"{group} fields ({', '.join(names)}, ...)" if names else "fields"
    where = f"conf/{group}/" if group else "conf/"
    return f"it holds {what}{shown}, not a mapping of {them}; write it as {where} does"


def _target(group: str, entry: str) -> str:
    """The config a defaults entry names: absolute (`/g/x`) or within the file's group."""
    entry = entry.removeprefix("override ").strip()
    return entry[1:] if entry.startswith("/") else "/".join(filter(None, [group, entry]))


def _check_loops(d: Path, links: dict[str, list[str]]) -> None:
    """A defaults list that reaches its own file again (hydra recursed until Python's limit)."""
    for start in links:
        todo, seen = list(links[start]), set()
        while todo:
            node = todo.pop()
            if node == start:
                raise MoepipeError(
                    f"{d / start}.yaml: its defaults list leads back to itself (through "
                    f"{', '.join(sorted(seen)) or 'its own name'}), a loop without end; remove one"
                    " of those entries"
                )
            if node not in seen:
                seen.add(node)
                todo += links.get(node, [])


def unquoted(value: str) -> str:
    """An override's value as hydra reads it where the user quoted it whole (`hardware='/a b/h
    é.yaml'`: a value beyond ASCII must be quoted); as typed otherwise."""
    quote, inner = value[:1], value[1:-1]
    if len(value) < 2 or quote not in ("'", '"') or value[-1] != quote:
        return value
    if quote in inner.replace("\\" + quote, ""):  # `'a.yaml','b.yaml'`: two values, each quoted
        return value
    return inner.replace("\\" + quote, quote)


def override_value(value: Any) -> str:
    """`value` as a hydra override's value that parses back to it: null, a bool, a number, or a
    quoted string (a path with spaces, commas or quotes stays one string)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return repr(value)
    text = str(value).replace("'", "\\'")
    return f"'{text}'"


def as_typed_path(path: str) -> str:
    """A path (`unquoted`'s, as hydra reads it) as a line's `pass KEY=...` shows it: as is
    where hydra's grammar takes it unquoted, else quoted (a space, a letter beyond ASCII)."""
    return path if re.fullmatch(r"[\w./:+-]+", path, re.ASCII) else override_value(path)


def group_files(
    argv: list[str], groups: Sequence[str], tmp: Path, files: dict[str, str]
) -> tuple[list[str], bool]:
    """`hardware=FILE.yaml` (a group of `groups`) as a config of that group: the file is copied
    to <tmp>/hardware/<stem>.yaml, which a search path entry adds (where the second value is
    true), and the argument names it; a sweep's files (`-m hardware=a.yaml,b.yaml`) each so.
    `files` maps the config's name back to the user's file, for error lines."""
    out, added = [], False
    for arg in argv:
        key, sep, typed = arg.partition("=")
        whole = unquoted(typed)  # a path quoted: beyond ASCII, a space, a comma
        values = [whole] if whole != typed else [unquoted(v) for v in typed.split(",")]
        if sep and key in groups and all(v.endswith((".yaml", ".yml")) for v in values):
            stems = [_group_file(arg, key, Path(v).expanduser(), tmp, files) for v in values]
            out.append(f"{key}={','.join(stems)}")
            added = True
        else:
            out.append(arg)
    return out, added


def _group_file(arg: str, key: str, src: Path, tmp: Path, files: dict[str, str]) -> str:
    """The config name under `tmp` of `src`, a file given as `key`'s config, checked and
    copied there."""
    what = not_regular(src) or (
        "a symbolic link to nothing" if src.is_symlink() and not src.exists() else ""
    )
    if what or not src.is_file():  # a FIFO, a folder or a loop was "no such file"
        where = "" if arg == f"{key}={src}" else f" ({src})"  # which, of a sweep's or quoted
        raise MoepipeError(
            f"{arg}: {what or 'no such file'}{where}; pass a {key} YAML file or a name in "
            f"conf/{key}/"
        )
    try:
        text = read_small(src, fix=f"pass a {key} YAML file").decode()
    except UnicodeDecodeError as e:
        raise MoepipeError(
            f"{arg}: not UTF-8 text (byte {e.start}); pass a {key} YAML file"
        ) from None
    check_yaml_size(text, arg, f"pass a {key} YAML file")
    _check_holds_fields(arg, key, text)
    stem = base = "file_" + re.sub(r"[^A-Za-z0-9_]", "_", src.stem)  # a name hydra takes bare
    while files.get(f"{key}/{stem}", str(src)) != str(src):  # a sweep's d1/h.yaml,d2/h.yaml
        stem = f"{base}_{len(files)}"
    (tmp / key).mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, tmp / key / f"{stem}.yaml")
    files[f"{key}/{stem}"] = str(src)
    return stem


def _check_holds_fields(arg: str, group: str, text: str) -> None:
    """YAML `text` (of `group=FILE.yaml`) holds a mapping of fields: not nothing (each group a
    file may give has fields it must set), not a scalar or a list. A file that does not parse
    is for the composition's own line, which names its line."""
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return
    if data is None:
        raise MoepipeError(
            f"{arg}: the file holds no fields; give the {group}'s fields in it (see "
            f"conf/{group}/ for the layout)"
        )
    wrong = not_fields(data, group)
    if wrong:
        raise MoepipeError(f"{arg}: {wrong}")


def chosen_file(key: str) -> str | None:
    """The YAML file the running job took `key`'s group from (`hardware.name`: the user's
    `hardware=FILE.yaml`, or conf/hardware/NAME.yaml), for a line about a field that file left
    out; None outside a job, or where the key is no group's."""
    from hydra.core.hydra_config import HydraConfig

    from experiments.common.app import USER_FILES

    group = key.split(".", 1)[0]
    try:
        choice = HydraConfig.get().runtime.choices.get(group)
    except Exception:  # noqa: BLE001 (no job running: nothing to name)
        return None
    if not isinstance(choice, str) or "." not in key:
        return None
    copied = next((v for k, v in USER_FILES.items() if k.endswith(f"/{group}/{choice}.yaml")), "")
    if copied:
        return copied
    from experiments.common.hydra_errors import CONF_DIR

    return (
        f"conf/{group}/{choice}.yaml" if (CONF_DIR / group / f"{choice}.yaml").is_file() else None
    )


_SCHEMA_LINE = re.compile(r"/planner_params@params:\s*([\w.-]+)")
_NAME_LINE = re.compile(r"^name:\s*([\w.-]+)\s*$", re.M)


def check_planner_files(dirs: Sequence[Path]) -> None:
    """Each planner file of `dirs` whose defaults take the params schema of another planner
    than its `name` (sequential.yaml copied, its name changed, its defaults line not): hydra
    then refused the params the file sets as unknown keys ("takes none: leave it out"), or
    added the other planner's own. Every file, not only those a `planner=` override chooses:
    an experiment file, a config dir's defaults or conf/config.yaml choose them too, past
    what a check before composing sees (as `check_conf_dirs` reads every file of a user's
    config dir). A MoepipeError naming the line to write. Read as text, not parsed."""
    from planners.registry import registered

    paths = sorted(p for d in dirs for p in (d / "planner").glob("*.yaml"))
    entries = registered() if paths else {}
    for path in paths:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError):
            continue  # not there (another folder's), or named by `_check_file` or hydra
        schema, name = _SCHEMA_LINE.search(text), _NAME_LINE.search(text)
        if not (schema and name) or schema[1] not in entries or name[1] not in entries:
            continue
        if entries[schema[1]].params is not entries[name[1]].params:
            raise MoepipeError(
                f"{path}: its defaults take /planner_params@params: {schema[1]}, planner "
                f"{schema[1]}'s params, but it is planner {name[1]}; write "
                f"`- /planner_params@params: {name[1]}`"
            )
