"""Collect every run directory under a sweep into one table (parquet + CSV).

One row per finished run: the flattened `config.yaml` (``model.name``, ``workload.batch_size``,
``planner.params.x`` ...) plus the flattened `summary.json` metrics (``throughput_tok_s``,
``busy_s.gpu``, ``plan.cache_hit_rate`` ...); lists (per-layer values) are JSON strings. A run
dir without a complete summary.json (interrupted, or still running) is reported and skipped.

Usage:
    python -m experiments.collect dir=SWEEP_DIR [out=DIR]   # writes DIR/results.{parquet,csv}
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml
from omegaconf import MISSING

from core.args import output_dir
from core.errors import MoepipeError
from core.routing import peek_suffix
from experiments.app import command
from experiments.cli import until_interrupted

RESULTS = "results"
_SKIP_KEYS: set[str] = set()  # summary keys not worth a column


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> dotted keys; lists -> JSON strings; scalars as they are."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if key in _SKIP_KEYS:
                continue
            if isinstance(v, dict):
                out.update(flatten(v, key))
            elif isinstance(v, list | tuple):
                out[key] = json.dumps(v)
            else:
                out[key] = v
    return out


def run_dirs(sweep_dir: Path) -> list[Path]:
    """Directories that are (or were about to be) runs: hydra's .hydra/, a config or a summary."""
    marks = ("summary.json", "config.yaml", ".hydra")
    found = {p.parent for m in marks for p in sweep_dir.rglob(m)}
    found = {d for d in found if d.name != ".hydra" and ".submitit" not in d.parts}
    return sorted(found)


def read_run(run: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(row, None) for a finished run, (None, what is missing) otherwise."""
    summary_path = run / "summary.json"
    if not summary_path.exists():
        failed = run / "failed.txt"  # experiments.run's one line for a point's bad input
        if failed.exists():
            try:
                return None, f"failed on bad input: {failed.read_text().strip()}"
            except (OSError, UnicodeDecodeError) as e:
                return None, f"failed on bad input (failed.txt unreadable: {_why(e)})"
        return None, "no summary.json (unfinished or interrupted)"
    try:
        summary = json.loads(summary_path.read_text())
        assert isinstance(summary, dict)
    except (json.JSONDecodeError, UnicodeDecodeError, AssertionError) as e:
        return None, f"summary.json unreadable ({type(e).__name__})"
    except OSError as e:  # a folder of that name, no permission
        return None, f"summary.json unreadable ({_why(e)})"
    for cfg_path in (run / "config.yaml", run / ".hydra" / "config.yaml"):
        if cfg_path.exists():
            try:
                config = yaml.safe_load(cfg_path.read_text()) or {}
            except yaml.YAMLError:
                return None, f"{cfg_path.relative_to(run)} unreadable"
            except (OSError, UnicodeDecodeError) as e:
                return None, f"{cfg_path.relative_to(run)} unreadable ({_why(e)})"
            break
    else:
        return None, "no config.yaml"
    if "status" not in summary and "throughput_tok_s" not in summary:
        return None, "summary.json has no metrics"
    row = {**flatten(config), **flatten(summary)}
    if "model" in summary:  # the model it ran: a real run's or hf_config's, not model='s group
        row["model.name"] = summary["model"]
    row.setdefault("status", "ok")
    row["system"] = system_of(run, row)
    row["has_trace"] = (run / "trace.parquet").exists()
    return row, None


def _why(e: Exception) -> str:
    if isinstance(e, UnicodeDecodeError):
        return "not UTF-8 text"
    return str(getattr(e, "strerror", None) or e)


def system_of(run: Path, row: dict[str, Any]) -> str:
    """What a run's planner is, as a sweep varied it: hydra's config choice (klotski_at_n and
    klotski_hot are both planner `klotski`), else the planner's name; a run that peeked at the
    routing says so (an upper bound, or not: `peek_suffix`)."""
    name = str(row.get("planner.name", row.get("planner", "?")))
    try:
        hydra = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text()) or {}
        name = str(hydra["hydra"]["runtime"]["choices"]["planner"])
    except (OSError, UnicodeDecodeError, yaml.YAMLError, KeyError, TypeError):
        pass
    return name + peek_suffix(str(row.get("planner_label", "")))


def collect(sweep_dir: str | Path) -> tuple[pd.DataFrame, list[str]]:
    """The sweep's table (one row per finished run, `run_dir` relative to the sweep) and the
    problems found ('<run dir>: <what is missing>')."""
    sweep = Path(sweep_dir)
    rows, problems = [], []
    for run in run_dirs(sweep):
        row, problem = read_run(run)
        rel = str(run.relative_to(sweep))
        if problem:
            problems.append(f"{rel}: {problem}")
            continue
        assert row is not None
        rows.append({"run_dir": rel, **row})
    df = pd.DataFrame(rows)
    if not df.empty:
        df = df.sort_values("run_dir", kind="stable").reset_index(drop=True)
    return df, problems


def write_results(df: pd.DataFrame, out_dir: str | Path) -> tuple[Path, Path]:
    out = output_dir(out_dir, "out")  # one line for a folder that cannot be made
    clean = df.copy()
    for c in clean.columns:  # parquet needs one type per column
        if clean[c].dtype == object and clean[c].map(type).nunique() > 1:
            clean[c] = one_type(clean[c])
    pq, csv = out / f"{RESULTS}.parquet", out / f"{RESULTS}.csv"
    for path in (pq, csv):  # checked before either is written
        if path.is_dir():
            raise MoepipeError(
                f"{path}: is a folder, where the results file goes; remove it or pass out= "
                "another folder"
            )
    try:
        clean.to_parquet(pq, index=False)
        clean.to_csv(csv, index=False)
    except OSError as e:
        raise MoepipeError(
            f"{e.filename or out}: cannot write it ({e.strerror or e}); pass out= a writable "
            "folder"
        ) from None
    return pq, csv


def one_type(col: pd.Series) -> pd.Series:
    """A column of mixed types as parquet can hold it: true/false where some runs lack the key
    as pandas' nullable boolean (it became the strings 'true' and 'NaN'); otherwise a missing
    value as None and anything but a string as JSON."""

    def missing(v: Any) -> bool:
        return v is None or (isinstance(v, float) and math.isnan(v))

    present = [v for v in col if not missing(v)]
    if present and all(isinstance(v, bool) for v in present):
        return col.map(lambda v: None if missing(v) else v).astype("boolean")
    return col.map(lambda v: None if missing(v) else v if isinstance(v, str) else json.dumps(v))


def load_sweep(sweep_dir: Path) -> tuple[pd.DataFrame, list[str]] | None:
    """`collect` for the CLIs: reports skipped runs on stderr; None if `sweep_dir` is no folder."""
    if not sweep_dir.is_dir():
        print(f"error: {sweep_dir} is not a directory", file=sys.stderr)
        return None
    df, problems = collect(sweep_dir)
    for p in problems:
        print(f"skipped {p}", file=sys.stderr)
    return df, problems


@dataclass
class Options:
    dir: str = MISSING  # the sweep folder (its run dirs hold config.yaml and summary.json)
    out: str | None = None  # where results.* go (default: dir)


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130 (the run dirs are only read)."""
    return int(until_interrupted(lambda: _app(argv)))


def _main(opts: Options) -> int:
    loaded = load_sweep(Path(opts.dir))
    if loaded is None:
        return 2
    df, problems = loaded
    if df.empty:
        print(f"error: no finished runs under {opts.dir}", file=sys.stderr)
        return 2
    try:
        pq, csv = write_results(df, Path(opts.out or opts.dir))
    except MoepipeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{len(df)} run(s), {len(problems)} skipped -> {pq}, {csv}")
    return 0


_app = command("collect", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(main())
