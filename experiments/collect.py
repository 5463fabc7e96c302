"""Collect every run directory under a sweep into one table (parquet + CSV).

One row per finished run, one column per quantity: the flattened `config.yaml` (``model.name``,
``workload.batch_size``, ``planner.params.x`` ...), then the `summary.json` metrics it does not
repeat (``throughput_tok_s``, ``busy_s.gpu``, ``plan.cache_hit_rate`` ...; ``n_batches`` is the n
a run ran, ``workload.n_batches`` the n it was given), and ``system``, the planner's display name.
Lists (per-layer values) are JSON strings; spaces in names become ``_``. A run dir without a
complete summary.json (interrupted, or still running) is reported and skipped.

Usage:
    python -m experiments.collect dir=SWEEP_DIR [out=DIR]   # writes DIR/results.{parquet,csv}
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from omegaconf import MISSING

from core.args import not_a_run_folder
from core.errors import MoepipeError
from experiments.common.app import command
from experiments.common.cli import exit_command, until_interrupted
from experiments.common.held_warnings import plan_accepted, say_line
from experiments.common.tables import counted, load_sweep, write_results  # noqa: E402


@dataclass
class Options:
    dir: str = MISSING  # the sweep folder (its run dirs hold config.yaml and summary.json)
    out: str | None = None  # where results.* go (default: dir)


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130 (the run dirs are only read)."""
    return int(until_interrupted(lambda: _app(argv)))


def _main(opts: Options) -> int:
    loaded = load_sweep(opts.dir)
    if loaded is None:
        return 2
    df, problems = loaded
    out = Path(opts.out or opts.dir).absolute()
    # the topmost folder of `out` not there yet: a failed write (a full disk) takes it away
    made = next((p for p in (out, *out.parents) if p.parent.exists()), out)
    fresh = not made.exists()
    try:
        not_a_run_folder(out, "out" if opts.out else "dir")  # results.* beside a run's files
        plan_accepted()  # inputs accepted: its warnings said now, not as it ends
        pq, csv = write_results(df, out)
    except BaseException as err:
        if fresh:
            shutil.rmtree(made, ignore_errors=True)
        if not isinstance(err, MoepipeError):
            raise
        say_line(err)
        return 2
    print(f"{counted(df, problems)} -> {pq}, {csv}")
    return 0


_app = command("collect", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
