"""The report page: a sweep as a static HTML page with PNG figures, readable offline. It opens
with who wins (experiments.common.ranking), then the figures with their captions
(experiments.common.figures), then every run, fastest first.

Usage:
    page = write_report(sweep_dir, out_dir)   # out_dir/index.html, its PNGs, results.parquet
"""

from __future__ import annotations

import html
from pathlib import Path

import pandas as pd

from core.args import refuse_their_png, refuse_theirs
from core.bubbles import top_cause
from core.shown import short_of
from experiments.common.figures import (
    fig_gantt,
    fig_idle_causes,
    fig_latency,
    line_figure,
    per_layer_figure,
    pick_gantt_runs,
)
from experiments.common.ranking import (
    LOWER_IS_BETTER,
    METRIC_LABELS,
    PANEL,
    RANK,
    TABLE_COLUMNS,
    WAITS,
    ReportError,
    answer,
    bubble_pct,
    check_request,
    idle_shares,
    ok_runs,
    ranking,
    times,
)
from experiments.common.run_dir import staged_outputs
from experiments.common.tables import (
    SYSTEM,
    collect,
    fixed,
    refuse_their_results,
    write_results,
)

PAGE_START = b"<!doctype html><html><head><meta charset='utf-8'>"  # how every page begins
PLOTS = (  # the figures a page may draw, each replacing the one of its name in out=
    "throughput_vs_batch.png",
    "throughput_vs_latency.png",
    "throughput_vs_n.png",
    "idle_causes.png",
    "gantt.png",
    "prefetch_accuracy.png",
    "load_balance.png",
)


def write_report(
    sweep_dir: str | Path,
    out_dir: str | Path | None = None,
    metric: str = "throughput_tok_s",
    columns: list[str] | None = None,
    df: pd.DataFrame | None = None,
    problems: list[str] | None = None,
) -> Path:
    """Write out_dir/index.html and its PNGs; returns the page's path."""
    sweep = Path(sweep_dir)
    out = Path(out_dir) if out_dir else sweep / "report"
    if df is None:
        df, problems = collect(sweep)
    df = _plottable(sweep, df)
    columns = columns or []
    check_request(df, metric, columns)
    refuse_theirs(out / "index.html", "out", PAGE_START)  # a page of the user's own, in out=
    refuse_their_results(out, "out")
    for name in PLOTS:  # a plot of the user's, alike
        refuse_their_png(out / name, "out")
    # into a folder of its own, moved in once whole, the page last: a report that fails midway
    # (a bad trace, a full disk) leaves no figure of its own beside an earlier page
    with staged_outputs(out, last="index.html") as tmp:
        figs = Figures()
        _line_figures(figs, df, metric, tmp)
        _cause_figures(figs, sweep, df, tmp)
        _layer_figures(figs, df, tmp)
        write_results(df, tmp)
        (tmp / "index.html").write_text(
            _html(sweep, df, figs.drawn, figs.notes, problems or [], columns)
        )
    return out / "index.html"


def _plottable(sweep: Path, df: pd.DataFrame) -> pd.DataFrame:
    """`df` with its system column; a ReportError when no run of it is feasible."""
    if SYSTEM not in df.columns and "planner.name" in df.columns:  # results of an older collect
        df = df.assign(**{SYSTEM: df["planner.name"]})
    if df.empty:
        raise ReportError(f"no finished runs under {sweep}")
    if ok_runs(df).empty:
        why = (
            str(df["error"].dropna().iloc[0]) if "error" in df and df["error"].notna().any() else ""
        )
        raise ReportError(
            f"no feasible runs under {sweep}: all {len(df)} are infeasible"
            + (f" (first: {why[:200]})" if why else "")
            + "; nothing to plot"
        )
    return df


class Figures:
    """The page's figures as they are drawn: (file, title, caption) of each drawn, and a note
    saying why for each left out."""

    def __init__(self) -> None:
        self.drawn: list[tuple[str, str, str]] = []
        self.notes: list[str] = []

    def add(self, ok: bool, name: str, title: str, caption: str, why: str) -> None:
        if ok:
            self.drawn.append((name, title, caption))
        else:
            self.notes.append(f"{title}: not drawn ({why}).")


def _line_figures(figs: Figures, df: pd.DataFrame, metric: str, out: Path) -> None:
    """`metric` against batch size, latency and n (Klotski's Figs. 10 and 11)."""
    mlabel = METRIC_LABELS.get(metric, metric)
    add = figs.add
    up = "the highest" if metric not in LOWER_IS_BETTER else "the lowest"
    add(
        line_figure(
            df,
            "workload.batch_size",
            metric,
            "batch size (sequences)",
            f"{mlabel} vs batch size",
            out / "throughput_vs_batch.png",
            logx=True,
        ),
        "throughput_vs_batch.png",
        f"{mlabel} vs batch size",
        f"Klotski Fig. 10's shape, one line per system. Read: {up} line at a batch size is the "
        "best system there; a line that stops short ran out of memory at the next size (the runs "
        "table lists infeasible runs).",
        "no system ran at two or more batch sizes",
    )
    add(
        fig_latency(df, metric, out / "throughput_vs_latency.png"),
        "throughput_vs_latency.png",
        f"{mlabel} vs latency",
        "Klotski Fig. 11's shape: each point is a run, its latency the time to finish a group of n "
        "batches; a system's runs at several batch sizes or n are joined."
        + (
            " Read: up and to the left is better; "
            "a point above and left of another beats it on both."
            if metric == "throughput_tok_s"
            else ""
        ),
        "fewer than two runs",
    )
    add(
        line_figure(
            df,
            "n_batches",
            metric,
            "n (batches per group)",
            f"{mlabel} vs n",
            out / "throughput_vs_n.png",
        ),
        "throughput_vs_n.png",
        f"{mlabel} vs n",
        "n is how many batches share each weight load. Read: a line still rising at its right end "
        "is still bound by weight loads there; where it flattens, compute or memory binds instead.",
        "no system ran at two or more n",
    )


def _cause_figures(figs: Figures, sweep: Path, df: pd.DataFrame, out: Path) -> None:
    """What the GPU bubbles wait on, and a timeline of one layer."""
    add = figs.add
    add(
        fig_idle_causes(df, out / "idle_causes.png"),
        "idle_causes.png",
        "Where the GPU bubbles come from",
        "Each bar is a run, fastest first; its length is the share of the run its GPUs computed "
        "nothing (the mean over its GPUs), split by the op each idle gap waited for, walked back "
        "along the gap's critical chain. Read: the longest segment is what to shorten first. Names "
        "are kind@resource: load expert@h2d is expert weights crossing the host-to-GPU link, load "
        "hidden@h2d / @d2h a batch's hidden states (its activations) crossing it, as a CPU "
        "expert's input and output do; kv-load / kv-store the KV cache; dispatch@p2p the "
        "all-to-all; compute-...@gpu another GPU's (or lane's) work, compute-...@cpu work on the "
        "CPU; memory@tier an op ready but waiting for memory; launch kernel launches; "
        "late@resource an op ready with its resource free that started late all the same (the "
        "executor's own delay).",
        "no run's GPUs idled, or the runs predate gpu_idle_causes_s",
    )
    runs = pick_gantt_runs(df)
    add(
        fig_gantt(sweep, runs, out / "gantt.png") if not runs.empty else False,
        "gantt.png",
        "Timeline of one layer",
        "One middle layer of one decode step per planner, fastest first, from trace.parquet: rows "
        "are streams, bars are ops, red spans are times the GPU computes nothing. Read: a red span "
        "under a load bar is the GPU waiting for that transfer; a layer with little red keeps the "
        "GPU busy.",
        "no run has a trace.parquet",
    )


def _layer_figures(figs: Figures, df: pd.DataFrame, out: Path) -> None:
    """Per MoE layer: prefetch accuracy, and expert-parallel runs' balancedness."""
    add = figs.add
    add(
        per_layer_figure(
            df,
            "plan.prefetch_accuracy_per_layer",
            "prefetch accuracy (useful / prefetched)",
            "Prefetch accuracy per MoE layer",
            out / "prefetch_accuracy.png",
        ),
        "prefetch_accuracy.png",
        "Prefetch accuracy per layer",
        "Share of the experts a planner prefetched that the gate then asked for, per MoE layer. "
        "Read: a layer well below the others is where the predictor misses, and each miss is a "
        "load the GPU waits on.",
        "no run records prefetch accuracy",
    )
    # expert-parallel runs' balancedness_per_layer ({MoE layer: mean/max device tokens}, which
    # collect flattens to one column a layer) as one list a run
    per_layer = sorted(
        (c for c in df.columns if c.startswith("balancedness_per_layer.")),
        key=lambda c: int(c.rsplit(".", 1)[1]),
    )
    bal = df.assign(_balancedness=df[per_layer].to_numpy().tolist()) if per_layer else df
    add(
        bool(per_layer)
        and per_layer_figure(
            bal,
            "_balancedness",
            "balancedness (mean / max device tokens)",
            "Balancedness per MoE layer",
            out / "load_balance.png",
        ),
        "load_balance.png",
        "Balancedness per MoE layer",
        "Expert-parallel runs: the mean over the max of the devices' tokens, per MoE layer. Read: "
        "1 is an even load; a line below another leaves its busiest GPU more work, so its layers "
        "take longer.",
        "no expert-parallel run in this sweep",
    )


def runs_table(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """Every run, fastest first within each (model, hardware) panel, with what its bubble waited
    on most (`WAITS`) beside its bubble; infeasible runs last."""
    shares = idle_shares(ok_runs(df))
    waits = (
        {i: top_cause(shares.loc[i].to_dict()) for i in shares.index} if not shares.empty else {}
    )
    d = df.assign(**{WAITS: [waits.get(i, "-") for i in df.index]})
    cols = [
        c
        for c in (*TABLE_COLUMNS[:1], *PANEL, *TABLE_COLUMNS[1:], *columns, "status")
        if c in d.columns
    ]
    keys = [c for c in PANEL if c in d.columns]
    return d.sort_values(
        [*keys, RANK], ascending=[True] * len(keys) + [False], na_position="last", kind="stable"
    )[cols]


def _share(v: float) -> str:
    return short_of(v, ".4g", 0, 1) if pd.notna(v) else "-"


def _answer_html(df: pd.DataFrame) -> list[str]:
    """The page's first section: per panel, the answer in words and the ranked table."""
    parts = []
    for key, t in ranking(df):
        ratio = f"{t['planner'].iloc[0]} / it"
        names = {
            "batch_size": "batch",
            "n": "n (ran)",
            RANK: "tok/s",
            "makespan_s": "makespan s",
            "gpu_bubble_frac": "GPU bubble",
            WAITS: "bubble waits on",
            "leader_over_it": ratio,
        }
        fmt = {
            "tok/s": fixed,
            "makespan s": fixed,
            ratio: times,
            "GPU bubble": lambda v: f"{bubble_pct(v)}%",
        }
        few = t.attrs.get("points", 0) < 2
        shown = t.drop(columns=["runs", "tied_wins", "tied_points", *(["wins"] if few else [])])
        ties = ", ties included" if t["tied_wins"].any() else ""
        names["wins"] = f"fastest at (of {t.attrs.get('points', 0)} points{ties})"
        shown = shown.rename(columns=names)
        parts.append(f"<p class='answer'>{html.escape(answer(key, t))}</p>")
        parts.append(shown.to_html(index=False, formatters=fmt, na_rep="-", border=0))
    parts.append(
        "<p class='note'>Each system at its best point of the sweep (repeats averaged). GPU bubble:"
        " the share of the run its GPUs computed nothing; what it waits on is the op each idle gap"
        " waited for (the figure below and <code>gpu_idle_causes_s</code> in summary.json).</p>"
    )
    return parts


def _html(
    sweep: Path,
    df: pd.DataFrame,
    figs: list[tuple[str, str, str]],
    notes: list[str],
    problems: list[str],
    columns: list[str],
) -> str:
    runs = runs_table(df, columns)
    # a share of the run is 1 or 0 only where it is (0.99996 is no "1"), with the digits to say so
    share = {c: _share for c in ("gpu_bubble_frac", "efficiency", "dag_efficiency") if c in runs}
    table = runs.to_html(
        index=False, formatters=share, float_format=lambda v: f"{v:.4g}", na_rep="-", border=0
    )
    e = html.escape
    parts = [
        PAGE_START.decode(),
        f"<title>moepipe report: {e(sweep.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:13px}"
        "td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
        ".note{color:#555}.answer{font-size:17px;line-height:1.4}</style></head><body>",
        f"<h1>moepipe report: {e(str(sweep))}</h1>",
        "<h2>Who wins</h2>",
        *_answer_html(df),
        f"<p>{len(df)} run(s) collected; simulated unless marked real. "
        "Data: results.parquet / results.csv.</p>",
    ]
    for name, title, caption in figs:
        parts.append(
            f"<h2>{e(title)}</h2><img src='{e(name)}' alt='{e(title)}'>"
            f"<p class='note'>{e(caption)}</p>"
        )
    if notes:
        parts.append(
            "<h2>Figures left out</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in notes) + "</ul>"
        )
    if problems:
        parts.append(
            "<h2>Skipped runs</h2><ul>" + "".join(f"<li>{e(p)}</li>" for p in problems) + "</ul>"
        )
    parts.append(f"<h2>Runs (fastest first)</h2>{table}</body></html>")
    return "\n".join(parts)
