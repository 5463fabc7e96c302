"""Hydra's compose, made cheaper for a test session's in-process commands (`cli_here`): each
command composes conf/'s same files afresh, and a compose of the tiny config took 0.1 s (0.5 s
under a profiler), most of it in making the same objects again. Eight steps of it keep what
they made, and each later call gets a copy that is what making it again would give:

- a config file loaded (`FileConfigSource.load_config`): OmegaConf's config of a file's text,
  kept by its source, path and text (a file a test edits is another text), copied by pickle
  (10 times faster than making it from the text);
- a config of hydra's own (`pkg://hydra.conf`, `ImportlibResourcesConfigSource.load_config`):
  kept by its path, copied by pickle;
- a stored schema loaded (`ConfigStore.load`): hydra deep-copies it each time; a pickle of it
  is copied instead, where it pickles (a schema class made at run time does not: deep copy);
- an override parsed (`OverridesParser.parse_rule`): kept by its text, deep-copied;
- the copy of the config sources each compose makes (`CachingConfigRepository`): the copy of
  the structured configs' source shares ConfigStore's one store (a compose loads copies of
  its entries, never changes it) where hydra deep-copied the whole store;
- the map a config's defaults list resolves its interpolations in (hydra's
  `_create_interpolation_map`, made for each config with a defaults list, 0.02 s each): kept
  by the choices and defaults it is made of, and shared (the defaults only read it);
- a value's interpolation parsed (OmegaConf's `grammar_parser.parse`): its parse tree kept by
  the text, rule and mode, and shared (OmegaConf's visitors read a tree, never change it).
- the config a defaults list composes to (`_compose_config_from_defaults_list`, two thirds of
  a kept compose: 0.037 of 0.055 s; a copy 0.004 s): kept by each default's path, package and
  where its config comes from (a file's text, hydra's package, a stored schema itself), copied
  by pickle. A default from any other source, or a file with a stored schema of its name
  (hydra merges that in, with a deprecation warning), is composed by hydra each time.

What fails (a missing file, bad YAML, a bad override) is not kept and fails again each time in
hydra's own code, with its own words. Files other than regular ones (a FIFO, /dev/zero) and
large ones are read by hydra as before.
"""

from __future__ import annotations

import copy
import functools
import io
import os
import pickle
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# the largest config file kept (a probe's huge or endless file is hydra's to read)
_KEPT_BYTES = 1 << 20
# a marker of a stored schema that does not pickle
_UNPICKLED = b""


def _kept(made: Any) -> tuple[bytes, dict[str, Any], str, str]:
    """A loaded ConfigResult as kept: its config pickled, its header, path and provider."""
    return pickle.dumps(made.config), dict(made.header), made.path, made.provider


def _result(kept: tuple[bytes, dict[str, Any], str, str]) -> Any:
    """A ConfigResult of its own made of one `_kept`."""
    from hydra.plugins.config_source import ConfigResult

    config, header, path, provider = kept
    return ConfigResult(
        config=pickle.loads(config), path=path, provider=provider, header=dict(header)
    )


def _text_of(full_path: str) -> str | None:
    """A regular config file's text, None where it is not one, is too large or does not read
    (hydra's own read then says what is wrong)."""
    try:
        st = os.stat(full_path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _KEPT_BYTES:
            return None
        with open(full_path, encoding="utf-8") as f:
            return f.read()
    except (OSError, ValueError):
        return None


def _file_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    """`FileConfigSource.load_config` keeping each file's config by its source, path and text."""
    kept: dict[tuple[str, ...], tuple[bytes, dict[str, Any], str, str]] = {}

    def load_config(self: Any, config_path: str) -> Any:
        name = self._normalize_file_name(config_path)
        full_path = os.path.realpath(os.path.join(self.path, name))
        text = _text_of(full_path)
        if text is None:
            return load(self, config_path)
        key = (self.path, name, full_path, text)
        if key not in kept:
            made = load(self, config_path)
            if _text_of(full_path) != text:  # rewritten meanwhile: which text it read is unknown
                return made
            kept[key] = _kept(made)
        return _result(kept[key])

    return load_config


def _package_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    """`ImportlibResourcesConfigSource.load_config` keeping each config of hydra's own package
    (`pkg://hydra.conf`: its files come with hydra) by its path."""
    kept: dict[str, tuple[bytes, dict[str, Any], str, str]] = {}

    def load_config(self: Any, config_path: str) -> Any:
        if self.path != "hydra.conf":
            return load(self, config_path)
        if config_path not in kept:
            kept[config_path] = _kept(load(self, config_path))
        return _result(kept[config_path])

    return load_config


def _schema_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    """`ConfigStore.load` copying each stored schema's config by pickle where it pickles."""
    kept: dict[int, tuple[Any, bytes]] = {}  # id(stored node) -> (that node, its pickle)

    def load_config(self: Any, config_path: str) -> Any:
        stored = self._load(config_path)
        node = stored.node
        if id(node) not in kept or kept[id(node)][0] is not node:
            try:
                kept[id(node)] = (node, pickle.dumps(node))
            except Exception:  # noqa: BLE001 (a class made at run time, or anything: deep copy)
                kept[id(node)] = (node, _UNPICKLED)
        pickled = kept[id(node)][1]
        if pickled == _UNPICKLED:
            return load(self, config_path)
        ret = copy.copy(stored)  # as hydra's: the stored entry itself is not changed
        ret.node = pickle.loads(pickled)
        return ret

    return load_config


def _override_parser(parse: Callable[..., Any]) -> Callable[..., Any]:
    """`OverridesParser.parse_rule` keeping each parsed override by its text."""
    kept: dict[str, Any] = {}

    def parse_rule(self: Any, s: str, rule_name: str) -> Any:
        if rule_name != "override":
            return parse(self, s, rule_name)
        if s not in kept:
            kept[s] = parse(self, s, rule_name)
        return copy.deepcopy(kept[s])

    return parse_rule


def _grammar_parser(parse: Callable[..., Any]) -> Callable[..., Any]:
    """OmegaConf's `grammar_parser.parse` keeping each parse tree by its arguments."""
    kept: dict[tuple[str, str, str], Any] = {}

    def parse_kept(
        value: str, parser_rule: str = "configValue", lexer_mode: str = "DEFAULT_MODE"
    ) -> Any:
        key = (value, parser_rule, lexer_mode)
        if key not in kept:
            kept[key] = parse(value, parser_rule, lexer_mode)
        return kept[key]

    return parse_kept


def _interpolation_map(make: Callable[..., Any]) -> Callable[..., Any]:
    """hydra's `_create_interpolation_map` keeping each map by what it holds: the choices known
    so far and the defaults list's entries, as hydra writes them into it."""
    from hydra.core.default_element import ConfigDefault, GroupDefault

    kept: dict[str, Any] = {}

    def map_kept(overrides: Any, defaults_list: list[Any], self_added: bool) -> Any:
        entries: list[Any] = []
        for d in defaults_list:
            if self_added and d.is_self():
                continue
            if isinstance(d, ConfigDefault):
                entries.append(d.get_config_path())
            elif isinstance(d, GroupDefault):
                entries.append({d.get_override_key(): d.value})
        key = repr((overrides.known_choices, entries))
        if key not in kept:
            kept[key] = make(overrides, defaults_list, self_added)
        return kept[key]

    return map_kept


class _Types(pickle.Pickler):
    """A pickler that keeps a class made at run time (a planner's params schema, module
    `types`) by reference: a composed config of one pickles, for this process to load."""

    made: dict[int, type] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, type) and obj.__module__ == "types":
            self.made[id(obj)] = obj
            return id(obj)
        return None


class _TypesBack(pickle.Unpickler):
    def persistent_load(self, pid: Any) -> Any:
        return _Types.made[pid]


def _made_of(defaults: list[Any], repo: Any) -> tuple[Any, list[Any]] | None:
    """What a defaults list's composed config is made of: each default's config path, package
    and primary flag, and where its config comes from (a file's text, a config of hydra's
    package, a stored schema, itself kept), with no stored schema of a file's name (hydra would
    merge one in, with a warning); and the stored schemas it reads. None where a default comes
    from anything else: that compose is not kept."""
    from hydra.core.config_store import ConfigStore
    from hydra.core.object_type import ObjectType
    from hydra.plugins.config_source import ConfigLoadError

    find = getattr(getattr(repo, "delegate", repo), "_find_object_source", None)
    if find is None:
        return None
    store, key, stored = ConfigStore.instance(), [], []
    for d in defaults:
        source = find(d.config_path, ObjectType.CONFIG) if d.config_path is not None else None
        if source is None:
            return None
        name = source._normalize_file_name(d.config_path)
        scheme = source.scheme()  # by its scheme: a test may have imported hydra's classes again
        if scheme == "structured" and source.provider == "schema":
            stored.append(store._load(name))
            where: Any = ("schema", id(stored[-1]))
        else:
            try:
                store._load(name)
                return None  # a schema of the file's name: hydra's deprecated merge
            except ConfigLoadError:
                pass
            if scheme == "file":
                full = os.path.realpath(os.path.join(source.path, name))
                where = ("file", source.path, full, _text_of(full))
                if where[-1] is None:
                    return None
            elif scheme == "pkg" and source.path == "hydra.conf":
                where = ("pkg", name)
            else:
                return None
        key.append((d.config_path, d.package, d.primary, d.is_self, where))
    return tuple(key), stored


def _composer(compose: Callable[..., Any]) -> Callable[..., Any]:
    """hydra's `_compose_config_from_defaults_list` keeping each composed config by what it is
    made of (`_made_of`), pickled; each later call gets its own copy of it."""
    kept: dict[Any, tuple[list[Any], bytes]] = {}

    @functools.wraps(compose)
    def compose_kept(self: Any, defaults: list[Any], repo: Any) -> Any:
        made_of = _made_of(defaults, repo)
        if made_of is None:
            return compose(self, defaults, repo)
        key, stored = made_of
        if key in kept and all(a is b for a, b in zip(kept[key][0], stored, strict=True)):
            return _TypesBack(io.BytesIO(kept[key][1])).load()
        cfg = compose(self, defaults, repo)
        out = io.BytesIO()
        try:
            _Types(out, protocol=pickle.HIGHEST_PROTOCOL).dump(cfg)
        except Exception:  # noqa: BLE001 (anything that does not pickle: not kept)
            return cfg
        again = _made_of(defaults, repo)
        if again is not None and again[0] == key:  # no file rewritten meanwhile
            kept[key] = (stored, out.getvalue())
        return cfg

    return compose_kept


def _source_copied_sharing_the_store(self: Any, memo: dict[int, Any]) -> Any:
    """`StructuredConfigSource`'s deep copy: itself copied, its `store` (ConfigStore's) shared."""
    made = copy.copy(self)
    memo[id(self)] = made
    return made


def _patches() -> list[tuple[Any, str, Any]]:
    """The (owner, name, replacement) of each step above, in hydra 1.3's and OmegaConf 2.3's
    names (an ImportError or AttributeError where another version moved one)."""
    from hydra._internal import defaults_list
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.config_store import ConfigStore
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.plugins import Plugins
    from omegaconf import _utils, base, grammar_parser

    Plugins.instance()  # its discovery registers the config sources' classes, its own copies
    file_source = SourcesRegistry.instance().resolve("file")
    structured_source = SourcesRegistry.instance().resolve("structured")
    package_source = SourcesRegistry.instance().resolve("pkg")
    parse = _grammar_parser(grammar_parser.parse)
    return [
        (file_source, "load_config", _file_loader(file_source.load_config)),
        (package_source, "load_config", _package_loader(package_source.load_config)),
        (ConfigStore, "load", _schema_loader(ConfigStore.load)),
        (OverridesParser, "parse_rule", _override_parser(OverridesParser.parse_rule)),
        (structured_source, "__deepcopy__", _source_copied_sharing_the_store),
        (
            ConfigLoaderImpl,
            "_compose_config_from_defaults_list",
            _composer(ConfigLoaderImpl._compose_config_from_defaults_list),
        ),
        (
            defaults_list,
            "_create_interpolation_map",
            _interpolation_map(defaults_list._create_interpolation_map),
        ),
        *((module, "parse", parse) for module in (_utils, base)),  # where OmegaConf calls it
    ]


@contextmanager
def composing_kept() -> Iterator[None]:
    """The steps above keep what they made while the block runs; where hydra or OmegaConf is
    another version whose names moved, nothing is kept and each compose is hydra's own."""
    try:
        patches = _patches()
    except (ImportError, AttributeError):
        patches = []
    with pytest.MonkeyPatch.context() as m:
        for owner, name, replacement in patches:
            m.setattr(owner, name, replacement, raising=False)
        yield
