"""5-fold cross-validation of the replication targets (issue 5) on held-out ESFT sequences.

The replication experiment reports its targets on one held-out split (`split=test`, the
sequences with seq_id % 5 == 0). How much that split moves a figure is seen by running the same
cases on every fold: fold K runs the sequences with seq_id % 5 == K and trains the tables
eplb / predictive / oracle start from on the other four. This runs the experiment's target cases
(`targets_cases`, at their largest batch) on the five folds, then prints per fold and case the
balancedness and makespan of eplb and predictive, the share of the ep_static -> oracle gap
predictive closes, and how many folds meet each target.

Usage:
    python -m experiments.replication_cv                    # folds in runs/replication/cv/<split>
    python -m experiments.replication_cv out_dir=/tmp/r 'planners.predictive_replication.window=2'

Takes any override of conf/experiment/replication.yaml (the cases other than the target cases
and the `variants` rows are not run). A fold whose report is written is not run again, so an
interrupted run resumes; a fold run with other settings is run again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from core.errors import MoepipeError
from experiments import replication
from experiments.cli import print_or_exit

log = logging.getLogger(__name__)
FOLDS = ("test", "fold1", "fold2", "fold3", "fold4")  # fold 0 is the test split


def fold_cfg(cfg: DictConfig, split: str) -> DictConfig:
    """The replication config of one fold: the target cases at their largest batch, no variants,
    out_dir/cv/<split>."""
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
        case["batch_sizes"] = [max(case["batch_sizes"])]
        cases[name] = case
    c.update(split=split, cases=cases, variants={}, out_dir=str(Path(cfg.out_dir) / "cv" / split))
    return OmegaConf.create(c)


def run_fold(cfg: DictConfig) -> list[dict[str, Any]]:
    """Runs one fold unless its report exists with the same config; returns its rows."""
    out = Path(cfg.out_dir)
    report, settings = out / "report.txt", OmegaConf.to_yaml(cfg, resolve=True)
    if report.exists() and (out / "config.yaml").read_text() == settings:
        log.info("%s: already run (%s)", cfg.split, report)
    else:
        report.unlink(missing_ok=True)
        lines = replication.run(cfg)
        report.write_text("\n".join(lines) + "\n")  # written last: marks the fold complete
    return replication.read_runs(out)


def cv_lines(rows: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The per-fold table, a mean row per case (the folds' mean of each column: the estimate over
    every held-out sequence, beside the one split the targets are reported on), and one line
    per case and target: on how many folds it is met."""
    head = (f"{'fold':>4} {'split':10} {'case':12} {'bs':>4} {'eplb bal':>9} {'pred bal':>9} "
            f"{'diff':>8} {'eplb ms':>8} {'pred ms':>8} {'gap closed':>10}")  # fmt: skip
    lines = [head, "-" * len(head)]
    # case -> per fold: (eplb bal, pred bal, diff, eplb ms, pred ms, gap closed)
    cols: dict[str, list[tuple[float, ...]]] = {}
    for k, split in enumerate(FOLDS):
        by_case: dict[str, dict[str, dict[str, Any]]] = {}
        for r in rows.get(split, []):
            by_case.setdefault(r["case"], {})[r["planner"]] = r
        for case, by in sorted(by_case.items()):
            st, ep = by["ep_static"], by["eplb"]
            orc, pr = by["oracle_replication"], by["predictive_replication"]
            diff = pr["balancedness"] - ep["balancedness"]
            gap = st["makespan_s"] - orc["makespan_s"]
            closed = (st["makespan_s"] - pr["makespan_s"]) / gap if gap > 0 else float("nan")
            lines.append(
                f"{k:>4} {split:10} {case:12} {pr['batch_size']:>4} {ep['balancedness']:>9.4f} "
                f"{pr['balancedness']:>9.4f} {diff:>+8.4f} {1e3 * ep['makespan_s']:>8.2f} "
                f"{1e3 * pr['makespan_s']:>8.2f} {closed:>10.0%}"
            )
            cols.setdefault(case, []).append(
                (ep["balancedness"], pr["balancedness"], diff, 1e3 * ep["makespan_s"],
                 1e3 * pr["makespan_s"], closed)
            )  # fmt: skip
    for case, per in sorted(cols.items()):
        eb, pb, diff, em, pm, closed = (sum(col) / len(per) for col in zip(*per, strict=True))
        lines.append(
            f"{'mean':>4} {f'{len(per)} folds':10} {case:12} {'':>4} {eb:>9.4f} {pb:>9.4f} "
            f"{diff:>+8.4f} {em:>8.2f} {pm:>8.2f} {closed:>10.0%}"
        )
    lines.append("")
    for case, per in cols.items():
        for what, k in (("balancedness >= eplb's", sum(c[2] >= 0 for c in per)),
                        ("closes >= 50% of the gap", sum(c[5] >= 0.5 for c in per))):  # fmt: skip
            ok = "PASS" if k == len(per) else "FAIL"
            lines.append(f"[{ok}] {case}: predictive {what} on {k} of {len(per)} folds")
    return lines


def run(cfg: DictConfig) -> list[str]:
    t0 = time.time()
    rows = {}
    for split in FOLDS:
        rows[split] = run_fold(fold_cfg(cfg, split))
        log.info("%s done at %.0f s", split, time.time() - t0)
    return [
        *cv_lines(rows),
        f"folds: {Path(cfg.out_dir) / 'cv'}/<split>/report.txt  ({time.time() - t0:.0f} s)",
    ]


@hydra.main(version_base="1.3", config_path="../conf", config_name="experiment/replication")
def main(cfg: DictConfig) -> None:
    print_or_exit(lambda: run(cfg))


if __name__ == "__main__":
    main()
