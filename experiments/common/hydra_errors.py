"""One line for a hydra/omegaconf composition error: the key or file at fault, the nearest valid
name and what to pass instead (`one_line`), for every command `experiments.common.app` builds."""

from __future__ import annotations

import re
import typing
from collections.abc import Sequence
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

import experiments.common.schema  # noqa: F401  registers the schemas
from core.args import non_finite
from core.errors import MoepipeError, did_you_mean, quoted
from experiments.common.command_options import taken_by, taken_elsewhere
from experiments.common.defaults_errors import (
    GROUP_PACKAGE,
    defaults_list_line,
    override_outside_global,
)
from experiments.common.int_ranges import (
    int_field_line,
    int_range,
    range_words,
    unit_given,
    whole_float,
)
from experiments.common.path_values import literal_dollar
from experiments.common.typed_values import as_typed

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"
FIX_VALUE = "fix that value in the config or override"  # a value that does not resolve
ROOT_SCHEMA: list[type] = []  # the running command's schema (set by `app.hydra_main`)
USER_DIRS: list[Path] = []  # its command line's config folders (set by `app._checked_args`)


def nearest(word: str, valid: Sequence[str]) -> str:
    """`; did you mean X?` for the valid name nearest `word`, then the valid names."""
    hint = did_you_mean(word, valid)
    return f"{hint}valid: {', '.join(sorted(map(str, valid)))}"


def _schema_keys(type_name: str) -> list[str] | None:
    """The fields of the schema dataclass named `type_name`, from those ConfigStore holds."""
    for cls in _schema_classes():
        if cls.__name__ == type_name:
            return [f.name for f in fields(cls)]
    return None


def _schema_classes() -> list[type]:
    """Every dataclass reachable from the running command's schema, then from the others
    stored in ConfigStore."""
    seen: dict[type, None] = {}
    for root in ROOT_SCHEMA:
        _walk_type(root, seen)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
            return
        cls = getattr(getattr(node, "node", None), "_metadata", None)
        typ = getattr(cls, "object_type", None)
        if is_dataclass(typ):
            _walk_type(typ, seen)

    walk(ConfigStore.instance().repo)
    return list(seen)


def _walk_type(cls: type, seen: dict[type, None]) -> None:
    import typing

    if cls in seen:
        return
    seen[cls] = None
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        for t in [hints.get(f.name), *typing.get_args(hints.get(f.name))]:
            for u in [t, *typing.get_args(t)]:
                if isinstance(u, type) and is_dataclass(u):
                    _walk_type(u, seen)


def one_line(e: BaseException, files: dict[str, str] | None = None) -> str | None:
    """A hydra or omegaconf composition error as one line naming the key and the nearest valid
    one; None for an error of another kind (a bug: its traceback is wanted). `files` maps a
    config's name to the user's file it was copied from (`group_files`)."""
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    from experiments.common.cli import error_line, our_check

    null = _override_into_null(e)
    if null is not None:
        return null
    if not isinstance(e, HydraException | OmegaConfBaseException):
        return None
    if isinstance(e, MissingConfigException):
        return _missing_choice(str(e))
    if isinstance(e, OverrideParseException):  # `key=[1`: the override named, as error_line does
        return error_line(e)
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__
    if not isinstance(cause, OmegaConfBaseException):
        cause = None
    text = f"{e}\n{cause}" if cause is not None and cause is not e else str(e)
    full = re.search(r"full_key: (\S+)", text)
    key = str(cause.full_key) if cause is not None and cause.full_key else ""
    key = key or (full.group(1) if full else "")
    ours = our_check(e)  # a check of ours inside an interpolation (`run_model`)
    if ours is not None:
        return str(ours)
    if isinstance(cause, MissingMandatoryValue):
        return f"{key}: required, it has no default; pass {key}=VALUE"
    where = re.match(r"In '([^']+)'", text)  # a key of a config file: the file named
    at = f" (in {_config_file(where.group(1), files)})" if where else ""
    if where:
        in_file = _not_fields(text, where.group(1), at, files)
        if in_file:
            return in_file
    converted = re.search(r"Cannot convert '(ListConfig|DictConfig|list|dict)' to (\w+)", text)
    if converted and key:  # `name: [a]` in a file, `dir=[a,b]` given
        what = "a list" if converted.group(1) in ("ListConfig", "list") else "a mapping"
        need = _KINDS.get(converted.group(2), converted.group(2))
        return f"{key}: {what} where {need} belongs{at}; pass {key}=<{need}>"
    unknown = re.search(r"Key '([^']*)' (?:is )?not in (?:struct|'(\w+)')", text)
    if unknown:  # (a key "" of a YAML file matched no line: a bare ConfigKeyError went out)
        name = unknown.group(1)
        ends = key == name or key.endswith(f".{name}")
        parent = (key[: len(key) - len(name)] if ends else key).rstrip(".")
        key = ".".join(filter(None, [parent, quoted(name)]))  # an empty or odd name shows
        argument = _argument_line(cause, key, name, at) or _package_line(where, key, at)
        if argument:
            return argument
        valid = _valid_keys(cause) if cause is not None else None
        valid = valid or (_schema_keys(unknown.group(2)) if unknown.group(2) else None)
        line = f"{key}: unknown key{at}" + (f"; {nearest(name, valid)}" if valid else "")
        line += taken_by(name) if key == name else taken_elsewhere(key, ROOT_SCHEMA[0])
        if valid == []:  # a schema of no fields (a planner with no params)
            line += f"; {key.rsplit('.', 1)[0]} takes none: leave it out"
        return line + _how_to_add(cause, key, text)
    wrong_type = _wrong_type(text, key, at, getattr(cause, "object_type", None))
    if wrong_type:
        return wrong_type
    typed = _value_for_fields(text, key, at)
    if typed:
        return typed
    merging = re.match(r"Error merging override (\S+)", text)
    if merging and merging.group(1).startswith("~"):  # a key a schema or hydra itself needs
        name = merging.group(1).lstrip("~").split("=")[0]
        return (
            f"~{name}: cannot be deleted (the config needs it); leave it out, or override it "
            f"instead ({name}=... or {name}.FIELD=...)"
        )
    if merging and cause is not None:
        return f"{merging.group(1)}: {str(cause).splitlines()[0]}"
    defaults = defaults_list_line(text) or override_outside_global(text, at)
    if defaults:
        return defaults
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if key and cause is not None:  # `dir=${oc.env:NOPE}`: omegaconf's lines end `full_key: dir`
        first = next(ln for ln in lines if not ln.startswith("full_key:"))
        return f"{key}: {first}{at}; {FIX_VALUE}{literal_dollar(key, first)}"
    return "; ".join(dict.fromkeys(lines[:2]))


def parse_problem(message: str) -> str:
    """What hydra's parse error `message` says is wrong, on its lines after the first ("Error
    parsing override 'KEY=VALUE'", which names no cause): `choice()`'s "empty choice is not
    legal", a keyword argument before a value, an unknown function with those hydra has, a
    sweep among a function's values (`shuffle(1,choice(2,3))`, hydra's AssertionError)."""
    lines = [line.strip() for line in message.splitlines()[1:] if line.strip()]
    if re.search(r"\b(?:Choice|Range|Interval)Sweep\b|^AssertionError ", "\n".join(lines), re.M):
        lines = ["a sweep among a sweep's values; list them in one: a,b,c or choice(a,b,c)"]
    causes = [re.sub(r"^\w+ while evaluating '.*?': ", "", line) for line in lines]
    why = "; ".join(c for c in causes if not c.startswith("See https://")) or (
        message.splitlines()[0] if message else "not hydra's override syntax"
    )
    page = "extended" if "(" in message.partition("\n")[0] else "basic"  # a function's page
    return f"{why} (see https://hydra.cc/docs/advanced/override_grammar/{page})"


def _override_into_null(e: BaseException) -> str | None:
    """An override of a key under a block the config leaves null (`replication.case=x` without
    the replication experiment that sets the block), or of the whole block: omegaconf's
    AssertionError or AttributeError while hydra applies it, "internal error" before. Found by
    the frame that applies overrides, which holds the override and the config."""
    from omegaconf import OmegaConf

    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_name != "_apply_overrides_to_config":
        tb = tb.tb_next
    if tb is None or not isinstance(e, AssertionError | AttributeError):
        return None
    override, cfg = tb.tb_frame.f_locals.get("override"), tb.tb_frame.f_locals.get("cfg")
    if override is None or cfg is None:
        return None
    parts = str(override.get_key_element()).lstrip("+~").split(".")
    nulls = [
        ".".join(parts[:i])
        for i in range(1, len(parts) + 1)
        if OmegaConf.select(cfg, ".".join(parts[:i])) is None
    ]
    if not nulls:
        return None
    given = str(override.input_line).lstrip("+~")  # as the user wrote it, not plus_plus's
    return (
        f"{given}: {nulls[0]} is null in this config, a block only the experiment that uses it "
        "sets; pass that experiment (experiment=NAME) or drop the override"
    )


def _value_for_fields(text: str, key: str, at: str) -> str | None:
    """A value where a mapping of fields belongs (a link given as a number, a list), or an
    override that cannot add a typed entry, as one line; None for another error."""
    listed = re.match(
        r"Error merging override \+*([^=\s]+)=(.*)\nCannot merge DictConfig with", text
    )
    if listed:  # `hardware.memory_gb=[1]`: omegaconf's line said what, not how to fix it
        schema = re.search(r"object_type=(\w+)", text)
        names = _schema_keys(schema.group(1)) if schema else None
        example = f"{listed.group(1)}.{names[0]}" if names else f"+{listed.group(1)}.NAME"
        return (
            f"{listed.group(1)}={listed.group(2)}: a list where a mapping"
            f"{' of ' + ', '.join(names) if names else ''} belongs; set its entries, "
            f"e.g. {example}=VALUE"
        )
    typed = re.search(r"Invalid type assigned: \w+ is not a subclass of (\w+)\. value: (.*)", text)
    if not typed:
        return None
    fields = ", ".join(_schema_keys(typed.group(1)) or [])
    merging = re.match(r"Error merging override \+*([^=\s]+)", text)
    if merging and not typed.group(2).startswith("{"):  # `hardware.memory_gb=5`
        first = fields.split(", ")[0]
        return (
            f"{merging.group(1)}={typed.group(2)}: a mapping of {fields} belongs there; "
            f"set its fields, e.g. {merging.group(1)}.{first}=VALUE"
        )
    if merging:  # `+hardware.links.p2p={gbps: 1}`: omegaconf cannot make a typed entry
        entry = re.sub(rf"\.({fields.replace(', ', '|')})$", "", merging.group(1))
        return (
            f"{entry}: an override cannot add an entry of {{{fields}}} here; add it to a "
            "YAML file of the group and pass that (e.g. hardware=FILE.yaml)"
        )
    return f"{key or 'a value'}: {typed.group(2)} where a mapping of {fields} belongs{at}"


def _not_fields(text: str, config: str, at: str, files: dict[str, str] | None) -> str | None:
    """The line for a list or a scalar in config `config`'s YAML (`hardware/mine`) where the
    schema has a mapping of fields: its key in the user's file, or the whole file."""
    group, _, name = config.rpartition("/")
    not_fields = re.search(r"Merge error: (\w+) is not a subclass of \w+", text)
    if re.search(r"Cannot merge DictConfig with ListConfig", text) or not_fields:
        schema = re.search(r"object_type=(\w+)", text)
        path = (files or {}).get(config) or _file_of(config)
        found = _misplaced(schema.group(1), path, group) if schema else None
        if found and isinstance(found[1], dict):  # a mapping where the schema has a list
            return (
                f"{found[0]}: a mapping {repr(found[1])[:40]} where a list belongs{at}; write "
                f"it as [a, b] (see conf/{group}/)"
            )
        if found:
            key, value, cls = found
            names = ", ".join(f.name for f in fields(cls)) if cls else "fields"
            return (
                f"{key}: {type(value).__name__} {repr(value)[:40]} where a mapping of {names} "
                f"belongs{at}; see conf/{group}/ for the layout"
            )
        if not not_fields:
            return f"{group}: a list where a mapping of fields belongs{at}; see conf/{group}/"
    if not_fields:  # a group's YAML that is a list or a scalar, not a mapping
        return (
            f"{group}={name}: its config is a {not_fields.group(1)}, not a mapping of "
            f"fields{at}; see conf/{group}/ for the layout"
        )
    return None


def _file_of(config: str) -> str | None:
    """The file config `config` (`model/mine`) was read from: conf/'s (where a researcher adds
    one), or a config folder of the command line's (`--config-dir`, `hydra.searchpath`)."""
    for folder in [CONF_DIR, *USER_DIRS]:
        if (folder / f"{config}.yaml").is_file():
            return str(folder / f"{config}.yaml")
    return None


Misplaced = tuple[str, Any, type | None]  # (dotted key, its value, the schema's class there)


def _misplaced(type_name: str, path: str | None, group: str) -> Misplaced | None:
    """The first value in the `group` YAML file at `path` that is a list or a scalar where the
    schema dataclass `type_name` (the group's, or the command's) has a mapping of fields, or a
    mapping where it has a list: omegaconf's merge error names no key."""
    cls = next((c for c in _schema_classes() if c.__name__ == type_name), None)
    try:
        data = yaml.safe_load(Path(path).read_text()) if path else None
    except (OSError, ValueError, yaml.YAMLError):
        return None
    if cls is None:
        return None
    if group in typing.get_type_hints(cls):  # the command's schema: the file is its group's
        return _misplaced_in(cls, {group: data})
    found = _misplaced_in(cls, data)
    return (f"{group}.{found[0]}", *found[1:]) if found else None


def _misplaced_in(cls: type, data: Any) -> Misplaced | None:
    if not isinstance(data, dict):
        return None
    hints = typing.get_type_hints(cls)
    for k, v in data.items():
        t = hints.get(k)
        if isinstance(v, dict) and any(
            typing.get_origin(a) in (list, tuple) for a in (t, *typing.get_args(t))
        ):  # `disk_block: {a: 1}`: omegaconf's merge error said "a list where a mapping"
            return str(k), v, None
        sub = next((a for a in (t, *typing.get_args(t)) if is_dataclass(a)), None)
        sub = sub if isinstance(sub, type) else None
        if v is not None and not isinstance(v, dict):
            if sub is not None and typing.get_origin(t) is not dict:
                return str(k), v, sub
            if typing.get_origin(t) is dict:
                return str(k), v, None
        if typing.get_origin(t) is dict and sub is not None and isinstance(v, dict):
            for entry, x in v.items():  # links.h2d: an entry of a mapping of LinkSchema
                if x is not None and not isinstance(x, dict):
                    return f"{k}.{entry}", x, sub
        elif sub is not None:
            found = _misplaced_in(sub, v)
            if found:
                return (f"{k}.{found[0]}", *found[1:])
    return None


def _package_line(where: re.Match[str] | None, key: str, at: str) -> str | None:
    """The line for a key a user's file of a group put outside the group's package: a model
    file with `# @package _global_` (or `hardware`), an experiment file without `# @package
    _global_` (its keys landed under `experiment.`): the header to fix, not the key."""
    group = where.group(1).split("/")[0] if where and "/" in where.group(1) else ""
    package = GROUP_PACKAGE.get(group)
    if package is None:
        return None
    inside = key == group or key.startswith(f"{group}.")
    if package == "_global_":
        if not inside:
            return None
        return (
            f"{key}: unknown key{at}; an {group} file sets the run's keys "
            "(workload.batch_size, ...): make `# @package _global_` its first line"
        )
    name = key.rsplit(".", 1)[-1]
    top = _schema_keys(f"{group.capitalize()}Schema") or []
    if inside and not (name in top and key != f"{group}.{name}"):  # not a field pushed down
        return None
    return (
        f"{key}: unknown key{at}; a {group} file's fields go under {group}, and a `# @package` "
        f"line put them elsewhere: remove that line (or write `# @package {group}`)"
    )


def _how_to_add(cause: Any, key: str, text: str) -> str:
    """What to pass for an override of an entry a free mapping lacks (`hardware.gpu.
    overhead_us_by_kind.load=1`: `+` adds it, as hydra's own message says); empty otherwise."""
    node = getattr(cause, "parent_node", None)
    meta = getattr(node, "_metadata", None)
    free = getattr(meta, "object_type", None) in (None, dict)
    element = getattr(meta, "element_type", None)
    if not text.startswith("Could not override") or not free or is_dataclass(element):
        return ""
    if key.startswith("hydra.sweeper.params."):  # a sweep goes on the command line
        return "; sweep it on the command line instead (-m KEY=a,b)"
    given = re.match(r"Could not override '([^']+)'", text)  # `a.b.c=1`: a is the entry missing
    name = given[1] if given and not key.startswith(f"{given[1]}.") else key  # `a={b: 1}`: a.b
    return f"; the mapping holds no such entry: add one with +{name}=VALUE"


def _wrong_type(text: str, key: str, at: str, owner: type | None = None) -> str | None:
    """The line for a value of the wrong type (a word for a number, a null where a value
    belongs, a scalar for a list, a word for a bool); None for an error of another kind."""
    wrong = re.search(r"Value '.*' of type 'dict' could not be converted to (\w+)", text)
    if wrong:  # `gpu_frac={a:1}`: omegaconf's line quoted the mapping and said no fix
        need = _KINDS.get(wrong.group(1), wrong.group(1))
        return f"{key}: a mapping where {need} belongs{at}; pass {key}=<{need}>"
    wrong = re.search(r"Value '(.*?)' (?:of type '\w+' )?could not be converted to (\w+)", text)
    given = as_typed(key, wrong.group(1), at) if wrong else ""
    if wrong and non_finite(wrong.group(1)):  # YAML's .inf, or inf for a whole number
        need = _KINDS.get(wrong.group(2), wrong.group(2))  # in check_finite's words
        return f"{key} must be a finite number, got {given}{at}; pass {key}=<{need}>"
    if wrong:
        need = _KINDS.get(wrong.group(2), wrong.group(2))
        whole = whole_float(wrong.group(1)) if wrong.group(2) == "Integer" else None
        low, high, _ = int_range(key, owner)
        if whole is not None and low <= whole <= (whole if high is None else high):  # 1e9
            return f"{key}={given}: an integer written as a float{at}; pass {key}={whole}"
        unit = unit_given(key, wrong.group(1))
        if unit:  # "16GB": the unit is in the key's name, the value a bare number
            need = range_words(key, owner) if wrong.group(2) == "Integer" else need
            return (
                f"{key}={given}: must be {need}{at}; the unit is {unit}, as the key's "
                f"name says: pass {key}=<a number in {unit}>, without a unit"
            )
        if wrong.group(2) == "Integer":  # 2.5, 1e300, abc: the range its own check says
            return int_field_line(key, given, at, owner)
        return f"{key}={given}: must be {need}{at}; pass {key}=<{need}>"
    wrong = re.search(r"Incompatible value '([^']*)' for field of type '(\w+)'", text)
    if wrong:  # `n_layers: null` in a YAML of the user's (a field that takes no null)
        need = _KINDS.get(wrong.group(2), wrong.group(2))
        got = "null" if wrong.group(1) == "None" else wrong.group(1)
        return f"{key}={got}: must be {need}{at}; give {key} a value"
    null = re.search(r"field '([^']+)' is not Optional", text)
    if null:  # `workload.batch_size=null`: omegaconf's line said what, not how to fix it
        name = null.group(1)
        return f"{name}=null: takes a value, not null{at}; pass {name}=VALUE"
    null = re.search(r"NoneType is not a subclass of (str|int|float|bool)\.", text)
    if null:  # `train=[null]`: an item of a list of values (omegaconf's line named no key)
        return f"{key}=null: an item of a list, which takes no null{at}; drop it or give it a value"
    if re.search(r"is not a ListConfig, list or tuple", text):  # `moe_layers=abc`
        return f"{key}: not a list{at}; pass {key}=[a,b]"
    wrong = re.search(r"Value '([^']*)' is not a valid bool", text)
    if wrong:
        given = as_typed(key, wrong.group(1), at)
        return f"{key}={given}: must be true or false{at}; pass {key}=true or false"
    wrong = re.search(r"Cannot assign (\w+) to (\w+)", text)
    if wrong:  # `sources: 5` in a user's YAML, where a mapping belongs
        need = _KINDS.get(wrong.group(2), wrong.group(2))
        return f"{key}: {wrong.group(1)} where {need} belongs{at}; give {key} {need}"
    return None


# the unit a config key's name carries (memory_gb.gpu, links.h2d.gbps, gpu.overhead_us)
def _config_file(name: str, files: dict[str, str] | None) -> str:
    """Where config `name` (`workload/mine`) came from: the user's file `group_files` copied,
    conf/<name>.yaml, or a folder on hydra.searchpath."""
    if (files or {}).get(name):
        return (files or {})[name]
    if (CONF_DIR / f"{name}.yaml").is_file():
        return f"conf/{name}.yaml"
    return f"{name}.yaml on hydra.searchpath"


def _missing_choice(text: str) -> str:
    """hydra's screen for `group=name` without conf/group/name.yaml, as one line."""
    m = re.search(r"Could not find '([^']+)/([^'/]*)'", text)
    if not m:
        return text.splitlines()[0]
    options = re.findall(r"^\t(\S+)$", text.split("Config search path")[0], re.M)
    group, name = m.groups()
    if not name:  # `experiment=`
        names = options or sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
        return f"{group}=: no name given; pass one of {', '.join(names)}, or leave it out"
    if group.startswith("hydra/"):  # `hydra/launcher=nosuch`: a group of hydra's own
        return f"{group}={name}: not a config of {group}; {nearest(name, options)}"
    if "/" in group and not (CONF_DIR / group).is_dir():  # `model=/a/b.txt`: hydra took
        # the value's folders for subgroups
        key, _, folder = group.partition("/")
        value = f"{folder}/{name}"
        files = (  # a .yaml path got here only where the group takes no file (a planner's)
            f"conf/{key}/ takes names only: copy the file there and pass its name"
            if value.endswith((".yaml", ".yml"))
            else f"a file is taken where it ends in .yaml: {key}=FILE.yaml"
        )
        near = nearest(Path(value).stem, options)
        return f"{key}={value}: not a name in conf/{key}/ ({files}); {near}"
    return f"{group}={name}: no conf/{group}/{name}.yaml; {nearest(name, options)}"


_KINDS = {
    "string": "a string",
    "Integer": "an integer",
    "Float": "a number",
    "Boolean": "true or false",
    "Dict": "a mapping",
    "List": "a list",
}


def _valid_keys(cause: Any) -> list[str] | None:
    """The keys at the node an omegaconf error names (its parent, or the object type)."""
    typ = getattr(cause, "object_type", None)
    if isinstance(typ, type) and is_dataclass(typ):
        return [f.name for f in fields(typ)]
    node = getattr(cause, "parent_node", None)
    if isinstance(node, DictConfig):
        return [str(k) for k in node]
    return None


def _argument_line(cause: Any, key: str, name: str, at: str) -> str | None:
    """For a key a `_target_` mapping lacks (a hydra callback's, which lists its class alone):
    how to add an argument its class takes, or the nearest one; None for another mapping."""
    from omegaconf import OmegaConf

    node = getattr(cause, "parent_node", None)
    if not isinstance(node, DictConfig) or "_target_" not in node:
        return None
    if is_dataclass(OmegaConf.get_type(node)):  # a plugin's schema: its fields are its keys
        return None
    takes = _arguments(str(node._get_node("_target_")._value()))
    if takes is None:
        return None
    if name in takes:
        return f"{key}: not set in the config{at}; add it with +{key}=VALUE"
    return f"{key}: unknown key{at}; {nearest(name, takes) if takes else 'it takes none'}"


def _arguments(target: str) -> list[str] | None:
    """The named arguments of the class or function `target` imports as; None where it does
    not import or takes any keyword."""
    import inspect

    from hydra._internal.utils import _locate

    try:
        params = inspect.signature(_locate(target)).parameters.values()
    except Exception:  # noqa: BLE001 (no such module, or no signature to read)
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]


def with_key(e: Exception, cfg: DictConfig) -> Exception:
    """An omegaconf error a command met reading `cfg` without the key it was reading (a value's
    interpolation that fails, read by `cfg.get`): a MoepipeError naming the first key of `cfg`
    whose value fails so; `e` itself otherwise."""
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(e, OmegaConfBaseException) or getattr(e, "full_key", None):
        return e
    key = _failing_key(cfg, "")
    if key is None:
        return e
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return MoepipeError(f"{key}: {msg}; {FIX_VALUE}{literal_dollar(key, msg)}")


def _failing_key(node: Any, prefix: str) -> str | None:
    """The dotted key of the first value under `node` that fails to resolve; None if none."""
    from omegaconf import ListConfig
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(node, DictConfig | ListConfig):
        return None
    keys = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
    for k in keys:
        if prefix == "" and k == "hydra":
            continue
        key = f"{prefix}{k}"
        try:
            value = node[k]
        except OmegaConfBaseException:
            return key
        found = _failing_key(value, f"{key}.")
        if found is not None:
            return found
    return None


def not_a_mapping(key: str, head: list[str], tail: list[str], typ: type) -> MoepipeError:
    """`key` (`head.tail`) sets a key under `head`, which the command's schema makes a `typ`
    value: one line saying so and what to pass, the command's own option where it takes
    `tail` itself (make_checkpoint's `model.n_layers=2`: n_layers=), else `head`."""
    where, rest = ".".join(head), ".".join(tail)
    own = is_dataclass(ROOT_SCHEMA[0]) and rest in {f.name for f in fields(ROOT_SCHEMA[0])}
    a = "an" if typ.__name__[0] in "aeiou" else "a"
    return MoepipeError(
        f"{key}: {where} is {a} {typ.__name__}, not a mapping of keys; pass "
        f"{rest if own else where}=VALUE"
    )
