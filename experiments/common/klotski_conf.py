"""The Klotski reproduction's configs, read as files (reproduce_klotski runs its grid without
hydra): conf/<group>/<name>.yaml, and an experiment file merged with its defaults, the keys its
table reads checked.

Usage:
    exp = experiment("klotski_fig14")   # exp["reproduce"]["batch_sizes"], exp["workload"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from core.errors import MoepipeError, integer_field, integer_words

CONF = Path(__file__).resolve().parents[2] / "conf"


def conf_yaml(group: str, name: str) -> dict[str, Any]:
    """conf/<group>/<name>.yaml as read."""
    return yaml.safe_load((CONF / group / f"{name}.yaml").read_text())


# what each table reads of its conf/experiment file's `reproduce` block
_NEEDS = {
    "klotski_table3": ("columns", "steps"),
    "klotski_fig14": ("n", "batch_sizes"),
    "klotski_vs_flexgen": ("columns", "batch_sizes"),
}


def experiment(name: str) -> dict[str, Any]:
    """conf/experiment/<name>.yaml with the files its defaults name merged under it (their
    workload and reproduce blocks), its reproduce block checked."""
    d = conf_yaml("experiment", name)
    for parent in [x for x in d.get("defaults", []) if isinstance(x, str) and x != "_self_"]:
        base = experiment(parent)
        base["workload"] = {**base.get("workload", {}), **d.get("workload", {})}
        base["reproduce"] = {**base.get("reproduce", {}), **d.get("reproduce", {})}
        d = base
    _check_reproduce(name, d.get("reproduce"))
    return d


def _check_reproduce(name: str, r: Any) -> None:
    """A MoepipeError naming the file and key where an edited experiment file's `reproduce`
    block lacks a key its table reads, or holds a list of sizes that is not one."""
    where = f"conf/experiment/{name}.yaml"
    if not isinstance(r, dict):
        raise MoepipeError(
            f"{where}: reproduce is {r!r}, not a mapping of its table's keys; write it as the "
            "shipped file has it (git checkout that file)"
        )
    for key in _NEEDS.get(name, ()):
        if key not in r:
            raise MoepipeError(
                f"{where}: reproduce.{key} is missing; its table reads it: add it, as the "
                "file's version in git has it"
            )
    for key in ("n", "batch_sizes"):
        v = r.get(key, [1])
        if not (
            isinstance(v, list)
            and v
            and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)
        ):
            raise MoepipeError(
                f"{where}: reproduce.{key}={v!r}: must be a list, each {integer_words(1)}; "
                "write e.g. [1, 4]"
            )
    if not isinstance(r.get("columns", []), list):
        raise MoepipeError(
            f"{where}: reproduce.columns is not a list of columns; write it as a list of "
            "{model, hardware, n} mappings"
        )
    for i, c in enumerate(r.get("columns", [])):
        _check_column(f"{where}: reproduce.columns[{i}]", c)


# Table 3's columns in the paper (reproduce_klotski.PAPER_T3): 8x7B / Env 1, 8x22B / Env 1,
# 8x22B / Env 2; a column's `paper_column` names the one it stands beside
PAPER_COLUMNS = 3


def _check_column(where: str, c: Any) -> None:
    """One Table 3 column: a mapping whose `n` (batches per group) is a positive integer and
    whose `paper_column` an index of the paper's columns (int() truncated 0.5 to 0)."""
    if not isinstance(c, dict):
        raise MoepipeError(f"{where} is {c!r}, not a mapping; give {{model, hardware, n}}")
    if "n" in c:
        integer_field(f"{where}.n", c["n"], 1, "write the batches per group, e.g. 15")
    if "paper_column" in c:
        fix = f"write the paper's column it stands beside: 0 to {PAPER_COLUMNS - 1}"
        if integer_field(f"{where}.paper_column", c["paper_column"], 0, fix) >= PAPER_COLUMNS:
            raise MoepipeError(f"{where}.paper_column={c['paper_column']}: past them; {fix}")


# results.csv's columns of whole numbers (reproduce_klotski writes each as one)
WHOLE_COLUMNS = ("column", "n", "batch_size", "gen_len")


def check_results(df: Any, path: Path) -> None:
    """A results.csv read back for report_only=true, refused in one line naming `path` where it
    is not what this code writes: Table 3 rows keyed by column and step, and each of
    `WHOLE_COLUMNS` a whole number where given (a hand-edited n=1.5 printed as Klotski's n)."""
    import pandas as pd

    if (df.table == "table3").any() and not {"column", "step"} <= set(df):
        raise MoepipeError(
            f"{path}: written before Table 3 rows were keyed by column and step; run it again"
        )
    for col in (c for c in WHOLE_COLUMNS if c in df):
        values = pd.to_numeric(df[col], errors="coerce")
        bad = df[col].notna() & (values.isna() | (values != values.round()))
        if bad.any():
            row = int(bad.to_numpy().argmax())
            raise MoepipeError(
                f"{path}: row {row + 1} has {col}={df[col].iloc[row]}, not a whole number as "
                "this code writes it; run reproduce_klotski again"
            )
