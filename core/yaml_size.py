"""How large a YAML text is once its aliases are expanded, checked before any loader expands
them: a YAML file given on the command line whose aliases nest (a "billion laughs") made the
config loaders build hundreds of millions of nodes, a hang; one nested thousands deep was a
RecursionError (libyaml's composer: a crash); an integer of 5000 digits a ValueError. Text that is
no YAML is named here too: a character YAML refuses (a NUL) left hydra's error without the file.
`UniqueKeyLoader` reads a user's file as omegaconf reads the files `run` reads: a key given twice
is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.errors import MoepipeError

MAX_NODES = 1_000_000  # far past any config moepipe reads (a calibrated hardware file: ~10^4)
# values aliases (*name) add, past those the text writes: omegaconf builds each at ~1 ms, so
# 6 levels of 9 (59,049 values) ran for a minute; no config of ours uses more than a few
MAX_ALIASED = 10_000
MAX_DEPTH = 200  # levels of nesting; a config has a handful
MAX_DIGITS = 4000  # under Python's int_max_str_digits (4300), past any count or size
_INT = "tag:yaml.org,2002:int"
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's where built: 6x faster


def check_yaml_size(text: str, where: str, fix: str) -> None:
    """A MoepipeError naming `where` when `text` is not YAML, or its documents, their aliases
    expanded, hold more than MAX_NODES nodes or nest too deeply to parse."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=_LOADER):  # libyaml's parser: no recursion
            if isinstance(event, yaml.SequenceStartEvent | yaml.MappingStartEvent):
                depth += 1
                if depth > MAX_DEPTH:  # composing it would recurse past Python's (or C's) stack
                    raise MoepipeError(f"{where}: nested too deeply to be a config; {fix}")
            elif isinstance(event, yaml.SequenceEndEvent | yaml.MappingEndEvent):
                depth -= 1
        docs = list(yaml.compose_all(text, Loader=_LOADER))
    except yaml.YAMLError as e:
        problem, line = yaml_problem(e, text)
        at = f":{line}" if line else ""
        raise MoepipeError(f"{where}{at}: not valid YAML ({problem}); {fix}") from None
    sizes: dict[int, int] = {}
    scalars: list[yaml.ScalarNode] = []
    total = sum(_expanded(doc, sizes, scalars) for doc in docs if doc is not None)
    if total > MAX_NODES:
        raise MoepipeError(
            f"{where}: over {MAX_NODES:,} values once its aliases (*name) are expanded (or an "
            f"alias inside itself, endless); no config is that large: {fix}"
        )
    if total - len(sizes) > MAX_ALIASED:  # each node written once is in `sizes` once
        raise MoepipeError(
            f"{where}: its aliases (*name) repeat {total - len(sizes):,} values, over "
            f"{MAX_ALIASED:,}; no config needs so many: write the values out, or {fix}"
        )
    for node in scalars:  # Python refuses to read an int of more digits (a ValueError)
        if node.tag == _INT and len(node.value) > MAX_DIGITS:
            line = node.start_mark.line + 1
            raise MoepipeError(
                f"{where}:{line}: an integer of {len(node.value)} digits, past any config "
                f"value; {fix}"
            )


def yaml_problem(e: yaml.YAMLError, text: str = "") -> tuple[str, int | None]:
    """What is wrong in a YAML text, and its line (1-based) where known: a character YAML
    refuses (a ReaderError) has no mark, only a position in `text`."""
    if isinstance(e, yaml.reader.ReaderError):
        line = text.count("\n", 0, e.position) + 1 if text else None
        char = f"#x{e.character:04x}" if isinstance(e.character, int) else repr(e.character)
        return f"character {char}: {e.reason}", line
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0] or type(e).__name__
    return problem, mark.line + 1 if mark is not None else None


def yaml_place(e: yaml.YAMLError) -> str:
    """`FILE:LINE: ` where YAML error `e` came from a file: its mark's, or for a character YAML
    refuses (a ReaderError, which has no mark) the file's name and the line of its position;
    "" where it came from a string."""
    mark = getattr(e, "problem_mark", None)
    if mark is not None:
        return f"{mark.name}:{mark.line + 1}: "
    name = getattr(e, "name", None)
    if not isinstance(e, yaml.reader.ReaderError) or not isinstance(name, str):
        return ""
    if name.startswith("<"):  # "<unicode string>", "<file>": no path to name
        return ""
    try:
        text = Path(name).read_bytes().decode("utf-8", "replace")
    except OSError:
        return f"{name}: "
    return f"{name}:{yaml_problem(e, text)[1]}: "


def _expanded(node: yaml.Node, sizes: dict[int, int], scalars: list[yaml.ScalarNode]) -> int:
    """Nodes under `node`, an alias's target counted at each use (each node sized once); each
    scalar node met is added to `scalars`."""
    stack, entered = [(node, False)], set()
    while stack:  # post-order without recursion: a long chain of aliases is no RecursionError
        n, children_done = stack.pop()
        if id(n) in sizes:
            continue
        kids = _children(n)
        if children_done:
            sizes[id(n)] = min(1 + sum(sizes[id(k)] for k in kids), MAX_NODES + 1)
            continue
        if id(n) in entered:  # its own descendant (`&a [*a]`): endless once expanded
            return MAX_NODES + 1
        entered.add(id(n))
        if isinstance(n, yaml.ScalarNode):
            scalars.append(n)
        stack.append((n, True))
        stack.extend((k, False) for k in kids if id(k) not in sizes)
    return sizes[id(node)]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (as omegaconf does for the
    files `run` reads): the later value would win without a word."""

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"found duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)
