"""The expert replication report (issue 5): the runs table, notes and targets over a sweep.

Runs come from `experiments.run` sweeps of conf/experiment/replication_<case>.yaml into one
folder (a case each; finished runs are reused when a sweep is run again):
    for c in esft_g8 esft_g4 esft_g8_b32 esft_g4_b32 switch_128 switch_256 switch_128_shared \\
        switch_128_loop switch_128_g8; do
        python -m experiments.run -m experiment=replication_$c; done
    python -m experiments.replication dir=runs/replication

Collects the folder's runs (as experiments.collect), prints the table, the notes and the
balancedness, makespan-gap and utilisation verdicts, and writes the plots (PNG), report.txt
(the printed lines) and index.html (both) to `out` (default: dir).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.args import not_a_run_folder, output_dir
from core.errors import MoepipeError
from core.files import cannot_write, no_folder_there
from core.hardware import HardwareSpec
from experiments.common import ep_notes, ep_plots, ep_rows
from experiments.common.app import command
from experiments.common.cli import (
    checked_names,
    exit_command,
    print_or_exit,
    until_interrupted,
)
from experiments.common.held_warnings import plan_accepted
from experiments.common.run_dir import staged_outputs
from experiments.common.tables import (
    collect,
    counted,
    refuse_their_results,
    say_skipped,
    skipped_note,
    write_results,
)

CASES = [
    "esft-g8",
    "esft-g4",
    "esft-g8-b32",
    "esft-g4-b32",
    "switch-base-128",
    "switch-base-256",
    "switch-base-128-shared",
    "switch-base-128-loop",
    "switch-base-128-g8",
]
VARIANTS = [
    "predictive_replication[gate=none]",
    "predictive_replication[window]",
    "eplb[interval=8]",
    "predictive_replication[layer_corr,gate=none]",
    "oracle_replication[truth=0.75]",
    "oracle_replication[truth=0.5]",
    "oracle_replication[truth=0.25]",
    "oracle_replication[split_load]",
    "ep_static[1 lane]",
    "ep_static[tbo]",
    "predictive_replication[tbo]",
    "oracle_replication[tbo]",
]


@dataclass
class Options:
    dir: str = "runs/replication"  # the sweep folder the cases ran into
    out: str | None = None  # where report.txt, index.html and the plots go (default: dir)
    cases: list[str] = field(default_factory=lambda: list(CASES))  # the table's case order
    variants: list[str] = field(default_factory=lambda: list(VARIANTS))  # rows after the four
    # held-out ESFT cases the balancedness and gap targets are judged on, each at its largest
    # batch whose batches need no more tokens than the split holds (beyond, the stream wraps and
    # the online learners have seen every token); the -b32 cases where replicas pay
    targets_cases: list[str] = field(
        default_factory=lambda: ["esft-g8", "esft-g4", "esft-g8-b32", "esft-g4-b32"]
    )
    # variant rows judged on the targets beside predictive (each a verdict line of its own)
    judged_variants: list[str] = field(
        default_factory=lambda: ["predictive_replication[gate=none]"]
    )


def load_rows(sweep: Path, opts: Options) -> list[dict[str, Any]]:
    """The sweep's replication runs, ordered, after writing its results table (collect's)."""
    if not sweep.is_dir():
        raise MoepipeError(
            f"dir={sweep}: {no_folder_there(sweep)}; run the cases first "
            "(python -m experiments.run -m experiment=replication_esft_g8)"
        )
    df, problems = collect(sweep)
    rows = ep_rows.rows_of(df) if not df.empty else []
    if not rows:  # one line: the skipped run dirs in it
        skipped = skipped_note(sweep, problems)
        raise MoepipeError(
            f"dir={sweep}: no finished replication runs; run a case first "
            "(python -m experiments.run -m experiment=replication_esft_g8)"
            f"{'; skipped' + skipped if skipped else ''}"
        )
    say_skipped(sweep, problems)
    print(f"{sweep}: {counted(df, problems)}", file=sys.stderr)  # as collect counts them
    write_results(df, sweep)
    return ep_rows.order_rows(rows, opts.cases, opts.variants)


def judged_batches(rows: list[dict[str, Any]], held_out: list[str]) -> dict[str, int | None]:
    """Each held-out ESFT target case's fresh batch (`ep_rows.fresh_batch`)."""
    shapes = ep_rows.case_shapes(rows)
    return {
        c: ep_rows.fresh_batch(shapes[c], int(shapes[c]["split_tokens"]))
        for c in held_out
        if shapes[c]["routing"] == "esft_heldout"
    }


def report_lines(rows: list[dict[str, Any]], opts: Options) -> tuple[list[str], dict]:
    """The printed lines (table, notes, targets) and the batch each target case is judged at."""
    ran = {r["case"] for r in rows}
    held_out = [c for c in opts.targets_cases if c in ran]  # the target cases that ran
    fresh = judged_batches(rows, held_out)
    first = rows[0]
    none_ran = (
        f"[n/a ] balancedness and makespan-gap targets: no case of "
        f"targets_cases={list(opts.targets_cases)} ran"
    )
    lines = [
        *ep_notes.dispatch_lines(str(first["params"].get("dispatch", "even"))),
        ep_rows.table(rows),
        "",
        *ep_notes.hardware_lines(HardwareSpec.from_dict(first["hardware"])),
        *ep_notes.reuse_lines(ep_rows.case_shapes(rows)),
        *ep_notes.work_conserving_lines(rows),
        *ep_notes.sharing_lines(rows),
        *ep_notes.loop_lines(rows),
        *ep_notes.eplb_lines(rows, held_out, fresh),
        *ep_notes.prediction_lines(rows, held_out, fresh),
        *([] if held_out else [none_ran]),
        *ep_rows.targets(rows, held_out, judged_variants(rows, opts), fresh),
    ]
    return lines, {c: fresh.get(c) for c in held_out}


def judged_variants(rows: list[dict[str, Any]], opts: Options) -> list[str]:
    """`judged_variants` that ran in every target case (the verdicts compare within a case)."""
    ran = {r["planner"] for r in rows}
    return [v for v in opts.judged_variants if v in ran]


def run(opts: Options) -> list[str]:
    t0 = time.time()
    for key, valid in (
        ("cases", CASES),
        ("variants", VARIANTS),
        ("targets_cases", CASES),
        ("judged_variants", VARIANTS),
    ):
        checked_names(key, getattr(opts, key), valid)
    sweep = Path(opts.dir)
    out = Path(opts.out or opts.dir)
    # the files it writes, before it reads the runs: none of them another's it would lose
    refuse_their_results(sweep, "dir")
    ep_plots.refuse_others(out)
    rows = load_rows(sweep, opts)
    not_a_run_folder(out, "out" if opts.out else "dir")
    output_dir(out, "out" if opts.out else "dir")  # a folder it cannot write, named as others do
    lines, judged = report_lines(rows, opts)
    plan_accepted()  # inputs accepted: its warnings said now, not as it ends
    # into a folder of its own, moved in once whole (as experiments.report's): a full disk left
    # plots cut short beside the earlier page, and its OSError named no file
    try:
        with staged_outputs(out, last="index.html") as tmp:
            # each target case gets its trade-off panel: a held-out one at its fresh batch, else
            # its largest
            pngs = ep_plots.plot(rows, tmp, sweep, judged)
            shown = ", ".join(str(out / p.name) for p in pngs)
            lines.append(f"plots: {shown}  ({time.time() - t0:.0f} s)")
            lines.append(f"report: {out / 'index.html'}")
            ep_plots.write_pages(tmp, lines, pngs)
    except OSError as e:
        raise MoepipeError(cannot_write(f"out={out}", e, "write the report")) from None
    return lines


def _main(opts: Options) -> int:
    print_or_exit(lambda: run(opts))
    return 0


_app = command("replication", Options, _main, __doc__)


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130 (the run dirs are only read)."""
    return int(until_interrupted(lambda: _app(argv)))


if __name__ == "__main__":
    exit_command(main)
