"""A sweep's run dirs on the command line: their last folder names the point's overrides
(`.../workload=tiny`, several joined by commas: `.../prompt_len=8,workload=tiny`), which
hydra's grammar takes only quoted. A value whose folders are there is quoted for the user
(`runs=[A/workload=tiny,B/workload=tiny]` as typed); one that is not is named with the quoted
form to paste (`overrides._parsed`)."""

from __future__ import annotations

import os

from experiments.common.overrides import _items


def path_items(text: str) -> list[str]:
    """`text` (a value, or a list's inside) as the folders it names: split at its commas
    outside brackets, a piece that is one `key=value` of a run dir's name (an `=`, no `/`)
    joined back to the one before, unless that one is a folder on its own and the two
    joined are not (two relative run dirs side by side)."""
    out: list[str] = []
    for piece in _items(text):
        joined = f"{out[-1]},{piece}" if out else ""
        alone = out and os.path.exists(out[-1]) and not os.path.exists(joined)
        if out and "=" in piece and "/" not in piece and not alone:
            out[-1] = joined
        else:
            out.append(piece)
    return out


def quoted_run_dirs(override: str) -> str:
    """`override` with its value quoted where it holds an unquoted `=` and every folder it
    names is there (a sweep's run dirs, which hydra's grammar refuses unquoted); as given
    otherwise (a parse error then says how to quote it)."""
    key, sep, value = override.partition("=")
    if not sep or "=" not in value or "'" in value or '"' in value or key.startswith("hydra."):
        return override
    listed = value.startswith("[") and value.endswith("]")
    items = path_items(value[1:-1] if listed else value)
    if not all(os.path.exists(i) for i in items):
        return override
    quoted = ",".join(f"'{i}'" for i in items)
    return f"{key}=[{quoted}]" if listed else f"{key}={quoted}"
