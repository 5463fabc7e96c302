"""Chrome/Perfetto trace (`trace.json`) of run directories, from their canonical trace.parquet.

Usage:
    python -m experiments.trace_json runs=RUN_DIR                  # writes RUN_DIR/trace.json
    python -m experiments.trace_json runs=[SIM_DIR,REAL_DIR] out=both.json  # 1 file, 2 processes

A run writes trace.parquet only (`trace_json=true` writes trace.json too); open the JSON in
ui.perfetto.dev: one process per source (per device for a run on G processes), one thread per
stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from core.args import output_file, written_whole
from core.balance import device_of
from core.chrome_trace import CHROME_START, chrome_parts, write_chrome
from core.errors import MoepipeError
from core.files import broken_link, cannot_write, read_summary_json
from core.trace import read_trace
from experiments.common.app import command
from experiments.common.cli import exit_command, until_interrupted
from experiments.common.dir_lock import dir_locked
from experiments.common.held_warnings import plan_accepted, say_line
from experiments.common.run_dir import OUTPUTS_BUSY, edited_since_run


def read_traces(run_dir: Path) -> list[pd.DataFrame]:
    """The run's trace as trace.json shows it: one part, or one per device of a run on G
    processes (its summary.json says `processes`)."""
    path = run_dir / "trace.parquet" if run_dir.is_dir() else run_dir
    # a folder in the trace's place is there: read_trace says what it is
    if not (path.exists() if path != run_dir else path.is_file()):
        raise MoepipeError(
            f"{run_dir}: no trace.parquet there{broken_link(run_dir)}; pass a run directory a "
            "run wrote"
        )
    trace = read_trace(path)
    summary = path.parent / "summary.json"
    try:
        processes = read_summary_json(summary).get("processes", 0)
    except (OSError, ValueError, AttributeError, RecursionError):
        processes = 0  # no summary (a bare trace.parquet): the trace's one part
    devices = len(set(device_of(trace["resource"]).tolist()))
    if type(processes) is not int or processes < 0 or processes > max(devices, 1):
        raise MoepipeError(
            f"{summary}: processes={processes} is not the run's (its trace has ops of {devices} "
            f"device(s)); an integer from 0 to {devices}: run that run again to rewrite it"
        )
    edited = edited_since_run(path.parent, ("trace.parquet", "summary.json"))
    if edited:  # ops cut or retimed by hand would be drawn as the run's
        raise MoepipeError(f"{edited}; run that run again to rewrite it")
    return chrome_parts(trace, processes)


@dataclass
class Options:
    runs: list[str] = field(default_factory=list)  # run directories (or trace.parquet files)
    out: str | None = None  # the JSON file (default: RUN_DIR/trace.json, for one run)


def _main(opts: Options) -> int:
    runs = [Path(r) for r in opts.runs]
    try:
        if not runs:
            raise MoepipeError("runs=RUN_DIR: name the run directory (or runs=[A,B] out=FILE)")
        if opts.out is None and len(runs) > 1:
            raise MoepipeError("several runs go into one file: name it with out=FILE")
        folders = [(r if r.is_dir() else r.parent).resolve() for r in runs]
        if len(set(folders)) < len(folders):  # its processes twice in one file
            raise MoepipeError(f"runs={opts.runs}: a run given twice; name each once")
        out = Path(opts.out) if opts.out is not None else folders[0] / "trace.json"
        if out.suffix != ".json":
            raise MoepipeError(f"out={out}: the Chrome trace is JSON; pass out=FILE.json")
        if out.name in ("summary.json", "config.json") and (out.parent / "summary.json").exists():
            raise MoepipeError(f"out={out}: a run's own file; pass out= another FILE.json")
        if (out.parent / "summary.json").exists() and out.parent.resolve() not in folders:
            raise MoepipeError(  # r2/trace.json holding r1's trace: a mix of two runs
                f"out={out}: the folder of another run than runs= names; pass out= a file "
                "outside it, or that run in runs="
            )
        # before the traces are read: a folder, one not writable, a file of another kind
        output_file(out, "out", starts=CHROME_START)
        # read and written while no run rewrites out's folder (a run dir: its lock), so that
        # trace.json is of the trace.parquet beside it
        with dir_locked(out.parent, OUTPUTS_BUSY):
            traces = [part for r in runs for part in read_traces(r)]
            plan_accepted()  # inputs accepted: its warnings said now, not as it ends
            try:
                with written_whole(out) as tmp:  # whole or not there (a full disk cut it short)
                    write_chrome(tmp, traces)
            except OSError as e:
                raise MoepipeError(cannot_write(f"out={out}", e)) from None
    except MoepipeError as e:
        say_line(e)
        return 2
    print(out)
    return 0


_app = command("trace_json", Options, _main, __doc__)


def main(argv: list[str] | None = None) -> int:
    return int(until_interrupted(lambda: _app(argv)))


if __name__ == "__main__":
    exit_command(main)
