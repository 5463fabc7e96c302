"""Turn a sweep into a static HTML report with PNG figures (readable offline).

The page opens with the answer: who has the highest throughput, by what ratio over each other
system (a ranked table), and what the winner's GPU bubble waits on. Then the figures, each with
a caption saying what to read from it, and every run, fastest first. A figure whose data the
sweep lacks is left out with a note saying why. It writes out/index.html, its PNG figures and
the sweep's results.parquet / results.csv (out defaults to DIR/report).

Usage:
    python -m experiments.report dir=SWEEP_DIR [out=DIR] [metric=throughput_tok_s]
        [columns=[planner.name,workload.batch_size]]   # extra columns for the run table
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import MISSING

from core.args import not_a_run_folder, output_dir
from core.errors import MoepipeError
from core.files import cannot_write, no_file_there
from experiments.common.app import command
from experiments.common.cli import exit_command, until_interrupted
from experiments.common.held_warnings import plan_accepted, say_line
from experiments.common.ranking import ReportError
from experiments.common.report_page import write_report
from experiments.common.tables import counted, load_sweep, shown

if TYPE_CHECKING:
    import pandas as pd


@dataclass
class Options:
    dir: str = MISSING  # the sweep folder
    out: str | None = None  # report folder (default: dir/report)
    metric: str = "throughput_tok_s"  # y axis of the line figures
    columns: list[str] = field(default_factory=list)  # extra columns for the run table


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130 (the run dirs are only read)."""
    return int(until_interrupted(lambda: _app(argv)))


def _main(opts: Options) -> int:
    sweep_dir = Path(opts.dir)
    loaded = load_sweep(opts.dir)
    if loaded is None:
        return 2
    df, problems = loaded
    out = Path(opts.out or sweep_dir / "report")
    fresh = not out.exists()
    try:  # one line for a folder that cannot be made, the default <sweep>/report too
        not_a_run_folder(out, "out")
        output_dir(str(out), "out")
        plan_accepted()  # inputs accepted: its warnings said now, not as it ends
        page = write_report(
            sweep_dir,
            Path(opts.out) if opts.out else None,
            opts.metric,
            [str(c) for c in opts.columns],
            df=df,
            problems=problems,
        )
    except (ReportError, MoepipeError) as err:
        _remove_if_made(out, fresh)
        say_line(err)
        return 2
    except OSError as err:  # a full disk while the figures are written: the error names no file
        _remove_if_made(out, fresh)
        say_line(cannot_write(f"out={out}", err, "write the report"))
        return 2
    except BaseException:
        _remove_if_made(out, fresh)
        raise
    warn_traceless(sweep_dir, df)
    print(f"report: {page} ({counted(df, problems)})")  # as collect counts them
    return 0


def warn_traceless(sweep_dir: Path, df: pd.DataFrame) -> None:
    """A warning line for each finished run without a trace.parquet (an infeasible run has
    none): the report leaves it out of the figures drawn from traces, which said nothing."""
    if {"has_trace", "status", "run_dir"} <= set(df.columns):  # an infeasible run has none
        lacking = df[(df["status"] == "ok") & ~df["has_trace"].fillna(False).astype(bool)]
        for run_dir in lacking["run_dir"]:
            # a folder or FIFO in its place is named as such: "no trace.parquet" hid it
            there = no_file_there(sweep_dir / str(run_dir) / "trace.parquet")
            print(
                f"warning: {sweep_dir / shown(str(run_dir))}/trace.parquet: {there}; the report "
                "leaves the run out of the Gantt figure (run it again to draw it)",
                file=sys.stderr,
            )


def _remove_if_made(out: Path, fresh: bool) -> None:
    """A report folder this command made, left empty by its failure, goes."""
    if fresh and out.is_dir() and not any(out.iterdir()):
        out.rmdir()


_app = command("report", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
