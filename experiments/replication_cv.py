"""5-fold cross-validation of the replication targets (issue 5) on held-out ESFT sequences.

The replication experiment reports its targets on one held-out split (`split=test`, the
sequences with seq_id % 5 == 0). How much that split moves a figure is seen by running the same
cases on every fold: fold K runs the sequences with seq_id % 5 == K and trains the tables
eplb / predictive / oracle start from on the other four. This runs the experiment's target cases
(`targets_cases`, at the batch the targets are judged at: the largest whose stream does not
revisit the fold's held-out tokens) on the five folds, then prints per fold and case the
balancedness and makespan of eplb and predictive, the share of the ep_static -> oracle gap
predictive closes, and how many folds meet each target.

A fold's figures also depend on the order its held-out sequences are streamed in (`seed` shuffles
them, so each order puts other sequences in each batch).
`cv_seeds=[0,1,2]` runs every fold in each of those orders (a (fold, seed) row each; the counts
and means are over all of them); by default the config's `seed` alone.

Usage:
    python -m experiments.replication_cv                    # folds in runs/replication/cv/<split>
    python -m experiments.replication_cv out_dir=/tmp/r 'planners.predictive_replication.window=2'
    python -m experiments.replication_cv 'cv_seeds=[0,1,2,3,4,5]'   # cv/<split>-seed<K> besides

Takes any override of conf/experiment/replication.yaml (the cases other than the target cases
and the `variants` rows are not run). A fold whose report is written is not run again, so an
interrupted run resumes; a fold run with other settings is run again.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from core.errors import MoepipeError
from experiments import replication
from experiments.common.cli import (
    as_int,
    run_command,
)
from experiments.common.pipeline import code_version

log = logging.getLogger(__name__)
FOLDS = ("test", "fold1", "fold2", "fold3", "fold4")  # fold 0 is the test split


def fold_cfg(cfg: DictConfig, split: str, seed: int | None = None) -> DictConfig:
    """The replication config of one fold: the target cases at their fresh batch
    (`replication.fresh_batch`, on the fold's split), no variants,
    out_dir/cv/<split>; with a `seed` other than the config's, that stream order, in
    out_dir/cv/<split>-seed<seed>."""
    replication.check_inputs(cfg)  # the case values it reads, in one line each
    c = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(c, dict)
    targets = [t for t in c["targets_cases"] if t in c["cases"]]
    if not targets:
        raise MoepipeError(
            f"targets_cases={c['targets_cases']} names none of the cases "
            f"({', '.join(c['cases'])}); name at least one held-out ESFT case"
        )
    cases = {}
    for name in targets:
        case = dict(c["cases"][name])
        if case["routing"] != "esft_heldout":
            raise MoepipeError(
                f"cases.{name}: routing {case['routing']!r} has no folds; "
                f"targets_cases must name esft_heldout cases"
            )
        # the batch the targets are judged at: the largest whose stream does not revisit the
        # fold's held-out tokens (the folds differ in size), else the largest
        held = len(replication.esft_split(c["trace_dir"], int(c["seed"]), split)[0])
        case["batch_sizes"] = [replication.fresh_batch(case, held) or max(case["batch_sizes"])]
        case.pop("variants", None)
        cases[name] = case
    where = split if seed is None or seed == c["seed"] else f"{split}-seed{seed}"
    c.update(split=split, cases=cases, variants={}, out_dir=str(Path(cfg.out_dir) / "cv" / where))
    if seed is not None:
        c["seed"] = seed
    return OmegaConf.create(c)


def seeds_of(cfg: DictConfig) -> list[int]:
    """`cv_seeds`, else the config's `seed`; one clear error for anything but integers."""
    if not cfg.get("cv_seeds"):
        return [as_int("seed", cfg.seed, at_least=0)]
    raw = cfg.cv_seeds
    if isinstance(raw, (int, str)) or not all(isinstance(x, int) and x >= 0 for x in raw):
        raise MoepipeError(f"cv_seeds={raw}: give a list of integers >= 0, e.g. cv_seeds=[0,1,2]")
    return list(dict.fromkeys(int(x) for x in raw))


def run_fold(cfg: DictConfig) -> list[dict[str, Any]]:
    """Runs one fold unless its report exists with the same config and code; returns its rows."""
    out = Path(cfg.out_dir)
    report, settings = out / "report.txt", OmegaConf.to_yaml(cfg, resolve=True)
    profile = replication.CONF / "hardware" / f"{cfg.hardware_profile}.yaml"
    code = code_version() + " " + hashlib.sha1(profile.read_bytes()).hexdigest()[:16]
    stamp = out / "code_version.txt"
    same_code = stamp.exists() and stamp.read_text() == code
    if report.exists() and same_code and (out / "config.yaml").read_text() == settings:
        log.info("%s: already run (%s)", cfg.split, report)
    else:
        report.unlink(missing_ok=True)
        lines = replication.run(cfg)
        stamp.write_text(code)
        report.write_text("\n".join(lines) + "\n")  # written last: marks the fold complete
    return replication.read_runs(out)


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
            st, ep = by["ep_static"], by["eplb"]
            orc, pr = by["oracle_replication"], by["predictive_replication"]
            diff = pr["balancedness"] - ep["balancedness"]
            gap = st["makespan_s"] - orc["makespan_s"]
            # as the report's gap_line: a gap under NOISE_GAP is noise, not judged (nan); no gap
            # at all (the oracle not faster) is judged, and fails: nan closes no half
            noise = 0 < gap < replication.NOISE_GAP * st["makespan_s"]
            closed = (
                (st["makespan_s"] - pr["makespan_s"]) / gap
                if gap > 0 and not noise
                else float("nan")
            )
            dist = pr.get("plan", {}).get("ep", {}).get("prediction_tv")
            dist = float("nan") if dist is None else float(dist)
            lines.append(
                f"{k:>4} {key:13} {case:12} {pr['batch_size']:>4} {ep['balancedness']:>9.4f} "
                f"{pr['balancedness']:>9.4f} {diff:>+8.4f} {1e3 * ep['makespan_s']:>8.2f} "
                f"{1e3 * pr['makespan_s']:>8.2f} {closed:>10.0%} {dist:>9.3f}"
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
            f"{diff:>+8.4f} {em:>8.2f} {pm:>8.2f} {closed:>10.0%} {dist:>9.3f}"
            + (
                f"  (gap closed over the {len(per) - no_gap} with a gap >= {replication.NOISE_GAP:.0%})"
                if no_gap
                else ""
            )
        )
    lines.append("")
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
            f"{len(judged)} {what_runs} whose gap is not under {replication.NOISE_GAP:.0%} of "
            f"ep_static's makespan ({len(per) - len(judged)} under it, noise"
            + (f"; {none} with no gap, the oracle not faster, close none)" if none else ")")
        )
    return lines


def run(cfg: DictConfig) -> list[str]:
    t0 = time.time()
    rows = {}
    seeds = seeds_of(cfg)
    for seed in seeds:
        for split in FOLDS:
            key = split if len(seeds) == 1 else f"{split} s{seed}"
            rows[key] = run_fold(fold_cfg(cfg, split, seed))
            log.info("%s done at %.0f s", key, time.time() - t0)
    return [
        *cv_lines(rows),
        f"folds: {Path(cfg.out_dir) / 'cv'}/<split>/report.txt  ({time.time() - t0:.0f} s)",
    ]


def main(argv: list[str] | None = None) -> int:
    """The command: conf/experiment/replication.yaml with `argv`'s overrides (sys.argv[1:])."""
    return replication.experiment_main(run, argv, __doc__, Path(__file__).stem)


if __name__ == "__main__":
    sys.exit(run_command(main))
