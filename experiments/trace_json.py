"""Chrome/Perfetto trace (`trace.json`) of run directories, from their canonical trace.parquet.

Usage:
    python -m experiments.trace_json RUN_DIR                   # writes RUN_DIR/trace.json
    python -m experiments.trace_json SIM_DIR REAL_DIR --out both.json   # one file, one process each

A run writes trace.parquet only (`trace_json=true` writes trace.json too); open the JSON in
ui.perfetto.dev: one process per source, one thread per stream.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from core.errors import MoepipeError
from core.trace import write_chrome


def read_trace(run_dir: Path) -> pd.DataFrame:
    path = run_dir / "trace.parquet" if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise MoepipeError(f"{run_dir}: no trace.parquet there; pass a run directory a run wrote")
    return pd.read_parquet(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run directories (or trace.parquet files)")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON file (default: RUN_DIR/trace.json, for one run)")  # fmt: skip
    args = ap.parse_args(argv)
    try:
        if args.out is None and len(args.runs) > 1:
            raise MoepipeError("several runs go into one file: name it with --out FILE")
        out = args.out or (args.runs[0] if args.runs[0].is_dir() else args.runs[0].parent)
        out = out / "trace.json" if args.out is None else out
        traces = [read_trace(r) for r in args.runs]
        try:
            write_chrome(out, traces)
        except OSError as e:
            raise MoepipeError(f"--out {out}: cannot write it ({e.strerror})") from None
    except MoepipeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
