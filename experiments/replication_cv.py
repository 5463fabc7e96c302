"""5-fold cross-validation of the replication targets (issue 5) on held-out ESFT sequences.

Fold K runs the sequences with seq_id % 5 == K and trains the tables eplb / predictive / oracle
start from on the other four; `workload.seed` orders a fold's sequences in the stream. Over a
folder of the target cases swept over folds and orders (the loop: docs/commands.md#replication_cv)
it prints per fold, order and case eplb's and predictive's balancedness and makespan at the
fold's fresh batch, the share of the ep_static -> oracle gap predictive closes, and how many runs
meet each target.

Usage: python -m experiments.replication_cv dir=runs/replication-cv
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import MoepipeError
from core.files import no_folder_there
from core.shown import short_of
from experiments.common import ep_rows
from experiments.common.app import command
from experiments.common.cli import exit_command, print_or_exit, until_interrupted
from experiments.common.ep_rows import NOISE_GAP
from experiments.common.held_warnings import plan_accepted
from experiments.common.tables import collect, counted, fixed, say_skipped, skipped_note

FOLDS = ("test", "fold1", "fold2", "fold3", "fold4")  # fold 0 is the test split
FOUR = ("ep_static", "eplb", "predictive_replication", "oracle_replication")


@dataclass
class Options:
    dir: str = "runs/replication-cv"  # the sweep folder the folds ran into


def fold_rows(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The four planners' rows of each (fold, stream order) at each case's fresh batch (the
    largest whose stream does not revisit the fold's held-out tokens, else its largest), keyed
    by split, or "<split> s<seed>" where the folder holds several orders."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        if r.get("split") in FOLDS and r["planner"] in FOUR:
            groups.setdefault((r["split"], int(r["workload"]["seed"])), []).append(r)
    seeds = {seed for _, seed in groups}
    out = {}
    for (split, seed), group in sorted(
        groups.items(), key=lambda kv: (kv[0][1], FOLDS.index(kv[0][0]))
    ):
        ep_rows.check_one_setting(group)
        keep = []
        for case, shape in ep_rows.case_shapes(group).items():
            bs = ep_rows.fresh_batch(shape, int(shape["split_tokens"])) or max(shape["batch_sizes"])
            keep += [r for r in group if r["case"] == case and r["batch_size"] == bs]
        out[split if len(seeds) == 1 else f"{split} s{seed}"] = keep
    return out


def _closed(closed: float, noise: list[bool]) -> str:
    """The gap closed as a share, or, where none is judged (nan), why: every gap `noise` (under
    NOISE_GAP), none at all (the oracle not faster), or some of each."""
    if not np.isnan(closed):
        return short_of(closed, ".0%", 0, 1)
    return "noise" if all(noise) else "no gap" if not any(noise) else "noise/none"


def _dist(dist: float) -> str:
    """`pred dist`, or "unknown" for a run from before `prediction_tv` was recorded (nan)."""
    return "unknown" if np.isnan(dist) else f"{dist:.3f}"


def cv_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The per-fold table, a mean row per case (the folds' mean of each column: the estimate over
    every held-out sequence, beside the one split the targets are reported on), and one line
    per case and target: on how many folds it is met. `rows` is keyed by split, or by
    "<split> s<seed>" for a fold in another stream order (then counted per (fold, seed)).
    `pred dist` is how far predictive's planned loads were from each batch's (its summary's
    `prediction_tv`; nan for a run from before it was recorded)."""
    head = (
        f"{'fold':>4} {'split':13} {'case':12} {'bs':>4} {'eplb bal':>9} {'pred bal':>9} "
        f"{'diff':>8} {'eplb ms':>8} {'pred ms':>8} {'gap closed':>10} {'pred dist':>9}"
    )
    lines = [head, "-" * len(head)]
    # case -> per fold: (eplb bal, pred bal, diff, eplb ms, pred ms, gap closed, pred dist)
    cols: dict[str, list[tuple[float, ...]]] = {}
    for key, fold_rows in rows.items():
        split = key.split()[0]
        k = FOLDS.index(split)
        by_case: dict[str, dict[str, dict[str, Any]]] = {}
        for r in fold_rows:
            by_case.setdefault(r["case"], {})[r["planner"]] = r
        for case, by in sorted(by_case.items()):
            missing = [name for name in FOUR if name not in by]
            if missing:
                raise MoepipeError(
                    f"fold {key}, case {case}: no finished run of {', '.join(missing)}; run "
                    "the sweep again to finish it (finished runs are reused)"
                )
            st, ep = by["ep_static"], by["eplb"]
            orc, pr = by["oracle_replication"], by["predictive_replication"]
            diff = pr["balancedness"] - ep["balancedness"]
            gap = st["makespan_s"] - orc["makespan_s"]
            # as the report's gap_line: a gap under NOISE_GAP is noise, not judged (nan); no gap
            # at all (the oracle not faster) is judged, and fails: nan closes no half
            noise = 0 < gap < NOISE_GAP * st["makespan_s"]
            closed = (
                (st["makespan_s"] - pr["makespan_s"]) / gap
                if gap > 0 and not noise
                else float("nan")
            )
            dist = pr.get("plan", {}).get("ep", {}).get("prediction_tv")
            dist = float("nan") if dist is None else float(dist)
            lines.append(
                f"{k:>4} {key:13} {case:12} {pr['batch_size']:>4} {ep['balancedness']:>9.4f} "
                f"{pr['balancedness']:>9.4f} {diff:>+8.4f} {fixed(1e3 * ep['makespan_s']):>8} "
                f"{fixed(1e3 * pr['makespan_s']):>8} {_closed(closed, [noise]):>10} "
                f"{_dist(dist):>9}"
            )
            cols.setdefault(case, []).append(
                (
                    ep["balancedness"],
                    pr["balancedness"],
                    diff,
                    1e3 * ep["makespan_s"],
                    1e3 * pr["makespan_s"],
                    closed,
                    dist,
                    float(noise),
                )
            )
    what_runs = "folds" if all(" " not in key for key in rows) else "runs"
    for case, per in sorted(cols.items()):
        eb, pb, diff, em, pm, closed, dist, _ = (
            float(np.nanmean(col)) if not np.isnan(col).all() else float("nan")
            for col in np.array(per).T
        )
        no_gap = sum(np.isnan(c[5]) for c in per)
        lines.append(
            f"{'mean':>4} {f'{len(per)} {what_runs}':13} {case:12} {'':>4} {eb:>9.4f} {pb:>9.4f} "
            f"{diff:>+8.4f} {fixed(em):>8} {fixed(pm):>8} "
            f"{_closed(closed, [bool(c[7]) for c in per]):>10} {_dist(dist):>9}"
            + (
                f"  (gap closed over the {len(per) - no_gap} with a gap >= {NOISE_GAP:.0%})"
                if no_gap
                else ""
            )
        )
    return [*lines, "", *verdicts(cols, what_runs)]


def verdicts(cols: dict[str, list[tuple[float, ...]]], what_runs: str) -> list[str]:
    """Per case: on how many runs each target is met (`cv_lines`' columns per run)."""
    lines = []
    for case, per in cols.items():
        k = sum(c[2] >= 0 for c in per)
        ok = "PASS" if k == len(per) else "FAIL"
        lines.append(
            f"[{ok}] {case}: predictive balancedness >= eplb's on {k} of {len(per)} {what_runs}"
        )
        judged = [c for c in per if not c[7]]
        k = sum(c[5] >= 0.5 for c in judged)
        ok = "n/a " if not judged else "PASS" if k == len(judged) else "FAIL"
        none = sum(np.isnan(c[5]) for c in judged)  # the oracle not faster: closes nothing
        lines.append(
            f"[{ok}] {case}: predictive closes >= 50% of the gap on {k} of the "
            f"{len(judged)} {what_runs} whose gap is not under {NOISE_GAP:.0%} of "
            f"ep_static's makespan ({len(per) - len(judged)} under it, noise"
            + (f"; {none} with no gap, the oracle not faster, close none)" if none else ")")
        )
    return lines


def run(opts: Options) -> list[str]:
    sweep = Path(opts.dir)
    if not sweep.is_dir():
        raise MoepipeError(
            f"dir={sweep}: {no_folder_there(sweep)}; sweep the folds first (see --help)"
        )
    df, problems = collect(sweep)
    folds = fold_rows(ep_rows.rows_of(df, one_setting=False) if not df.empty else [])
    if not folds:  # one line: the skipped run dirs in it
        skipped = skipped_note(sweep, problems)
        raise MoepipeError(
            f"dir={sweep}: no finished held-out ESFT runs of the four planners; sweep the "
            f"folds first (see --help){'; skipped' + skipped if skipped else ''}"
        )
    plan_accepted()  # inputs accepted: its warnings said now, not as it ends
    say_skipped(sweep, problems)
    print(f"{sweep}: {counted(df, problems)}", file=sys.stderr)  # as collect counts them
    return cv_lines(folds)


def _main(opts: Options) -> int:
    print_or_exit(lambda: run(opts))
    return 0


_app = command("replication_cv", Options, _main, __doc__)


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130 (the run dirs are only read)."""
    return int(until_interrupted(lambda: _app(argv)))


if __name__ == "__main__":
    exit_command(main)
