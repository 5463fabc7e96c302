"""The report's figures (PNG, matplotlib's Agg backend): lines against a swept axis, throughput
against latency, where the GPU bubbles come from, a one-layer Gantt chart, and per-layer lines.
Each returns False when the sweep lacks its data, and the page says why.

Usage:
    drawn = fig_idle_causes(df, out / "idle_causes.png")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from experiments.common.mpl_quiet import agg

agg()
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from core.args import PNG_METADATA, written_whole  # noqa: E402
from core.errors import MoepipeError  # noqa: E402
from core.trace import read_trace  # noqa: E402
from experiments.common.ranking import (  # noqa: E402
    IDLE_SHOWN,
    METRIC_LABELS,
    PANEL,
    RANK,
    idle_shares,
    line_groups,
    ok_runs,
    panel_groups,
)
from experiments.common.run_dir import edited_since_run  # noqa: E402
from experiments.common.tables import SYSTEM  # noqa: E402

MARKERS = "osD^vP*Xph<>"  # one per line, so points at one place stay told apart


def _label_points(
    ax: Any, points: list[tuple[float, float, str, Any, bool]], fontsize: float = 7.5
) -> None:
    """Name each line in its colour: a line of several points in the margin right of the axes,
    level with its last point, where it crosses no line; a lone point beside itself, towards the
    middle of the axes. Names that would overlap (planners at about one throughput) are stacked
    apart, each with a leader line to its point. Call after the layout is final: it works in
    display points."""
    to_pt = 72.0 / ax.figure.dpi
    box = ax.get_window_extent()
    gap = fontsize * 1.35
    groups: dict[str, list[tuple[float, float, float, float, str, Any]]] = {}
    for x, y, text, color, margin in points:
        px, py = ax.transData.transform((x, y))
        side = "margin" if margin else "left" if px > (box.x0 + box.x1) / 2 else "right"
        groups.setdefault(side, []).append((py * to_pt, px * to_pt, x, y, text, color))
    for side, items in groups.items():
        items.sort()
        crowds: list[list[int]] = []  # runs of names that had to be pushed apart
        placed: list[float] = []
        for i, (y_pt, *_) in enumerate(items):
            if placed and y_pt < placed[-1] + gap:
                placed.append(placed[-1] + gap)
                crowds[-1].append(i)
            else:
                placed.append(y_pt)
                crowds.append([i])
        shift = max(0.0, placed[-1] - (box.y1 * to_pt - gap / 2)) if placed else 0.0
        for crowd in crowds:
            xs = [items[i][1] for i in crowd]
            # names clear of every point of the crowd, or of the axes for the margin
            edge = (
                box.x1 * to_pt + 4
                if side == "margin"
                else min(xs) - 9
                if side == "left"
                else max(xs) + 9
            )
            for i in crowd:
                y_pt, x_pt, x, y, text, color = items[i]
                dy = placed[i] - shift - y_pt
                leader = dict(arrowstyle="-", color=color, lw=0.6, alpha=0.7)
                ax.annotate(
                    text,
                    xy=(x, y),
                    xytext=(edge - x_pt, dy),
                    textcoords="offset points",
                    ha="right" if side == "left" else "left",
                    va="center",
                    fontsize=fontsize,
                    color=color,
                    annotation_clip=False,
                    arrowprops=leader if side == "margin" or len(crowd) > 1 else None,
                )


def line_figure(
    df: pd.DataFrame, x: str, metric: str, xlabel: str, title: str, path: Path, logx: bool = False
) -> bool:
    """One subplot per (model, hardware) panel, one line per system."""
    d = ok_runs(df).dropna(subset=[x, metric])
    panels = panel_groups(d)
    # a line needs two x values: the n a planner picked for itself is no line
    if d.empty or not any(s[x].nunique() > 1 for _, g in panels for _, s in line_groups(g, x)):
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False)
    ends = []
    for ax, (key, g) in zip(axes[0], panels, strict=True):
        for i, (label, s) in enumerate(line_groups(g, x)):
            s = s.groupby(x, as_index=False)[metric].mean().sort_values(x)  # repeats of a point
            (ln,) = ax.plot(s[x], s[metric], marker=MARKERS[i % len(MARKERS)], label=label)
            ends.append((ax, s[x].iloc[-1], s[metric].iloc[-1], label, ln.get_color(), len(s) > 1))
        ax.set_xlabel(xlabel)
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.set_title(" / ".join(map(str, key)) or title, fontsize=10)
        if logx:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(g[x].unique()), [str(int(v)) for v in sorted(g[x].unique())])
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    _finish(fig, ends, path)
    return True


def _finish(fig: Any, ends: list[tuple[Any, float, float, str, Any, bool]], path: Path) -> None:
    """Lay the figure out, leaving a margin right of each panel for the names of lines of
    several points, name each line (`_label_points`), and save it."""
    margin = any(e[5] for e in ends)
    fig.tight_layout(rect=(0, 0, 0.84, 1) if margin else (0, 0, 1, 1))
    if margin and len(fig.axes) > 1:
        fig.subplots_adjust(wspace=0.5)
    for ax in {id(e[0]): e[0] for e in ends}.values():
        _label_points(ax, [(x, y, label, c, m) for a, x, y, label, c, m in ends if a is ax])
    with written_whole(path) as tmp:  # whole or not there
        fig.savefig(tmp, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)


def fig_latency(df: pd.DataFrame, metric: str, path: Path) -> bool:
    """Throughput against the latency of a group (its makespan), one curve per system."""
    d = ok_runs(df).dropna(subset=["makespan_s", metric])
    if len(d) < 2:
        return False
    panels = panel_groups(d)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False)
    ends = []
    for ax, (key, g) in zip(axes[0], panels, strict=True):
        for i, (label, s) in enumerate(line_groups(g, "n_batches", "workload.batch_size")):
            s = s.sort_values("makespan_s")
            (ln,) = ax.plot(
                s["makespan_s"], s[metric], marker=MARKERS[i % len(MARKERS)], label=label
            )
            ends.append(
                (
                    ax,
                    s["makespan_s"].iloc[-1],
                    s[metric].iloc[-1],
                    label,
                    ln.get_color(),
                    len(s) > 1,
                )
            )
        ax.set_xlabel("latency: makespan of a group of n batches (s)")
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.set_xscale("log")
        ax.set_title(" / ".join(map(str, key)), fontsize=10)
        ax.grid(alpha=0.3)
    what = METRIC_LABELS.get(metric, metric).split(" (")[0]
    fig.suptitle(f"{what[0].upper()}{what[1:]} vs latency (each point: one batch size / n)")
    _finish(fig, ends, path)
    return True


def fig_idle_causes(df: pd.DataFrame, path: Path) -> bool:
    """One bar per run: the share of its makespan its GPUs ran no kernel (the mean over its
    GPUs), split by what that idle time waited for (core.bubbles), the largest causes named."""
    d = ok_runs(df)
    share = idle_shares(d)
    if share.empty:  # no run with causes (no columns), or no run
        return False
    if len(share.columns) > IDLE_SHOWN:
        rest = share.columns[IDLE_SHOWN - 1 :]
        share = share.drop(columns=rest).assign(other=share[rest].sum(axis=1))
    bars = []  # (throughput, name, shares): fastest first, as the ranked table
    for label, g in line_groups(d):
        for idx, r in g.iterrows():
            name = label + (
                f", bs {int(r['workload.batch_size'])}, n {int(r['n_batches'])}"
                if len(g) > 1
                else ""
            )
            bars.append((-float(r.get(RANK, 0.0)), name, share.loc[idx].to_numpy()))
    bars.sort(key=lambda b: b[0])
    names, rows = [b[1] for b in bars], [b[2] for b in bars]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(11, 1.4 + 0.32 * len(rows)))
    left = np.zeros(len(rows))
    colors = plt.get_cmap("tab10").colors
    for j, cause in enumerate(share.columns):
        w = np.array([r[j] for r in rows])
        ax.barh(y, w, left=left, color=colors[j % len(colors)], label=cause)
        left += w
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1)
    ax.set_xlabel("share of the run its GPUs computed nothing, by what they waited for")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title("Where the GPU bubbles come from")
    fig.tight_layout()
    with written_whole(path) as tmp:  # whole or not there
        fig.savefig(tmp, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return True


def pick_gantt_runs(df: pd.DataFrame) -> pd.DataFrame:
    """One run per planner, all at the configuration most planners share (fair comparison)."""
    d = ok_runs(df)
    d = d[d["has_trace"].fillna(False).astype(bool)] if "has_trace" in d else d
    if d.empty:
        return d
    keys = [k for k in (*PANEL, "workload.batch_size", "workload.n_batches") if k in d.columns]
    counts = d.groupby(keys)[SYSTEM].nunique().sort_values(ascending=False, kind="stable")
    best = counts.index[0] if len(keys) > 1 else (counts.index[0],)
    sel = d
    for k, v in zip(keys, best if isinstance(best, tuple) else (best,), strict=True):
        sel = sel[sel[k] == v]
    # a real run is a run dir of its own: one per system and executor, so it shows beside the sim
    by = [SYSTEM, *(["executor.name"] if "executor.name" in sel else [])]
    sel = sel.drop_duplicates(by)  # fastest first, as the ranked table
    return sel.sort_values(RANK, ascending=False) if RANK in sel else sel.sort_values(by)


def _layer_window(trace: pd.DataFrame) -> tuple[pd.DataFrame, float, float, int, int]:
    """Ops of one middle layer of one decode step (step 1, or the prefill if there is none)."""
    step = 1 if (trace["step"] == 1).any() else 0
    layers = sorted(trace.loc[trace["layer"] >= 0, "layer"].unique())
    layer = int(layers[len(layers) // 2]) if layers else -1
    sel = trace[(trace["step"] == step) & (trace["layer"] == layer) & (trace["kind"] != "free")]
    if (sel["batch"] >= 0).any():  # batch-at-a-time planners repeat the layer per batch: the first
        sel = sel[sel["batch"] == sel.loc[sel["batch"] >= 0, "batch"].min()]
    t0, t1 = float(sel["start_s"].min()), float(sel["end_s"].max())
    window = trace[(trace["end_s"] > t0) & (trace["start_s"] < t1) & (trace["kind"] != "free")]
    return window, t0, t1, step, layer


# op kind -> (legend name, colour), for the timelines and their legend
OP_COLORS = {
    "compute-attention": ("attention", "tab:blue"),
    "compute-gate": ("gate", "tab:purple"),
    "compute-expert": ("expert", "tab:green"),
    "compute-ffn": ("dense FFN", "tab:olive"),
    "compute-head": ("head", "tab:gray"),
    "load": ("load", "tab:orange"),
    "kv-load": ("kv load", "tab:cyan"),
    "kv-store": ("kv store", "tab:pink"),
}


def _gantt_axis(ax: Any, trace: pd.DataFrame, title: str) -> None:
    window, t0, t1, step, layer = _layer_window(trace)
    streams = list(dict.fromkeys(window.sort_values("stream")["stream"].astype(str)))
    colors = {kind: c for kind, (_, c) in OP_COLORS.items()}
    for i, s in enumerate(streams):
        ops = window[window["stream"].astype(str) == s]
        for _, r in ops.iterrows():
            a, b = max(r["start_s"], t0), min(r["end_s"], t1)
            alpha = 1.0 if r["layer"] == layer else 0.45  # other layers' ops (prefetch) lighter
            ax.barh(
                i,
                (b - a) * 1e3,
                left=(a - t0) * 1e3,
                color=colors.get(str(r["kind"]), "k"),
                alpha=alpha,
                edgecolor="none",
                height=0.7,
            )
    gpu = window[window["resource"].astype(str) == "gpu"].sort_values("start_s")
    t = t0
    for _, r in gpu.iterrows():  # shade GPU idle time (bubbles) across all rows
        if r["start_s"] > t + 1e-9:
            ax.axvspan((t - t0) * 1e3, (r["start_s"] - t0) * 1e3, color="red", alpha=0.12, lw=0)
        t = max(t, r["end_s"])
    if t < t1 - 1e-9:
        ax.axvspan((t - t0) * 1e3, (t1 - t0) * 1e3, color="red", alpha=0.12, lw=0)
    ax.set_yticks(range(len(streams)), streams, fontsize=7)
    ax.set_xlim(0, max((t1 - t0) * 1e3, 1e-6))
    ax.set_title(f"{title}: step {step}, layer {layer}", fontsize=9)
    ax.set_xlabel("time from the layer's first op (ms)")


def fig_gantt(sweep: Path, runs: pd.DataFrame, path: Path) -> bool:
    items = []
    for _, r in runs.iterrows():
        trace = read_trace(sweep / r["run_dir"] / "trace.parquet")
        edited = edited_since_run(sweep / r["run_dir"], ("trace.parquet",))
        if edited:  # ops cut or retimed by hand would be drawn as the run's
            raise MoepipeError(f"{edited}; run that run again to rewrite it")
        for source in ("real", "sim"):  # real above sim where a real run exists
            t = trace[trace["source"].astype(str) == source]
            if not t.empty:
                items.append(
                    (
                        f"{r[SYSTEM]} ({source}, bs {r.get('workload.batch_size')}, "
                        f"n {r.get('n_batches')})",
                        t,
                    )
                )
    if not items:
        return False
    fig, axes = plt.subplots(len(items), 1, figsize=(11, 1.2 + 1.6 * len(items)), squeeze=False)
    for ax, (title, t) in zip(axes[:, 0], items, strict=True):
        _gantt_axis(ax, t, title)
    from matplotlib.patches import Patch

    handles = [
        Patch(color=c, label=k) for k, c in (*OP_COLORS.values(), ("GPU bubble", (1, 0, 0, 0.25)))
    ]
    fig.suptitle(
        "One layer per planner (lighter: ops of other layers in the same window; red: GPU idle)",
        fontsize=10,
    )
    fig.legend(handles=handles, loc="lower center", ncol=9, fontsize=8)  # below the plots
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    with written_whole(path) as tmp:  # whole or not there
        fig.savefig(tmp, dpi=100, metadata=PNG_METADATA)
    plt.close(fig)
    return True


def per_layer_figure(df: pd.DataFrame, column: str, ylabel: str, title: str, path: Path) -> bool:
    if column not in df.columns:
        return False
    d = ok_runs(df).dropna(subset=[column])
    if d.empty:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, g in line_groups(d):  # every run (one per system and swept point)
        for _, r in g.iterrows():
            vals = json.loads(r[column]) if isinstance(r[column], str) else r[column]
            y = np.array([np.nan if v is None else v for v in vals], dtype=float)
            ax.plot(np.arange(len(y)), y, marker=".", label=label)
    ax.set_xlabel("MoE layer")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with written_whole(path) as tmp:  # whole or not there
        fig.savefig(tmp, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return True


def fig_sim_vs_real(planner: str, sim: pd.DataFrame, real: pd.DataFrame, path: Path) -> None:
    """validate's timeline of one planner: its simulated trace above its measured one, each
    stream a row, each op a bar coloured by its kind."""
    fig, axes = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
    kinds = sorted(set(sim["kind"].astype(str)) | set(real["kind"].astype(str)))
    colors = {k: plt.cm.tab10(i % 10) for i, k in enumerate(kinds)}
    for ax, df, title in ((axes[0], sim, "simulated"), (axes[1], real, "measured (real)")):
        streams = list(dict.fromkeys(df["stream"].astype(str)))
        for i, s in enumerate(streams):
            d = df[df["stream"].astype(str) == s]
            for kind, g in d.groupby(d["kind"].astype(str)):
                ax.broken_barh(
                    list(zip(g["start_s"], g["end_s"] - g["start_s"], strict=True)),
                    (i - 0.4, 0.8),
                    color=colors[kind],
                )
        ax.set_yticks(range(len(streams)), streams)
        ax.set_title(f"{planner}: {title}, makespan {df['end_s'].max():.3f} s")
    axes[1].set_xlabel("seconds")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90, metadata=PNG_METADATA)
    plt.close(fig)
