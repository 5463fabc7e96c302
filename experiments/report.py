"""Turn a sweep into a static HTML report with PNG figures (readable offline).

The page opens with the answer: who has the highest throughput, by what ratio over each other
system (a ranked table), and what the winner's GPU bubble waits on. Then the figures, each with
a caption saying what to read from it, and every run, fastest first. A figure whose data the
sweep lacks is left out with a note saying why.

Usage:
    python -m experiments.report dir=SWEEP_DIR [out=DIR] [metric=throughput_tok_s]
        [columns=[planner.name,workload.batch_size]]   # extra columns for the run table
"""

from __future__ import annotations

import html
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from omegaconf import MISSING  # noqa: E402

from core.args import output_dir  # noqa: E402
from core.bubbles import top_cause  # noqa: E402
from core.errors import MoepipeError  # noqa: E402
from experiments.common.app import command  # noqa: E402
from experiments.common.cli import run_command, until_interrupted  # noqa: E402
from experiments.common.tables import SYSTEM, collect, load_sweep, write_results  # noqa: E402

# swept workload columns: a figure against one of them draws a line per value of the others
AXES = {"workload.batch_size": "bs", "n_batches": "n", "workload.prompt_len": "prompt",
        "workload.gen_len": "gen"}  # fmt: skip
PANEL = ("model.name", "hardware.name")
LOWER_IS_BETTER = {"makespan_s", "gpu_bubble_frac", "gpu_bubble_s"}
METRIC_LABELS = {
    "throughput_tok_s": "throughput (tokens/s)",
    "makespan_s": "makespan (s)",
    "gpu_bubble_frac": "GPU bubble (fraction of makespan)",
    "efficiency": "efficiency (busiest-resource bound / makespan)",
    "dag_efficiency": "efficiency (the schedule's own bound / makespan)",
    "gpu_bubble_s": "GPU bubble (s)",
}
IDLE = "gpu_idle_causes_s"  # summary.json's {cause: seconds}, flattened by collect to IDLE.<cause>
IDLE_SHOWN = 7  # causes a figure names; the rest are drawn as one "other"
WAITS = "bubble_waits_on"  # the runs table's column: top_cause of a run's idle causes
TABLE_COLUMNS = [SYSTEM, "executor.name", "workload.batch_size", "n_batches", "throughput_tok_s", "makespan_s",
                 "gpu_bubble_frac", WAITS, "efficiency", "dag_efficiency"]  # fmt: skip


class ReportError(ValueError):
    """A bad report request (unknown metric or column); the message lists the valid ones."""


def numeric_columns(df: pd.DataFrame) -> list[str]:
    return sorted(
        c for c in df.columns if pd.api.types.is_numeric_dtype(df[c]) and df[c].notna().any()
    )


def check_request(df: pd.DataFrame, metric: str, columns: list[str]) -> None:
    valid_metrics = numeric_columns(df)
    if metric not in valid_metrics:
        raise ReportError(f"unknown metric {metric!r}; valid: {', '.join(valid_metrics)}")
    bad = [c for c in columns if c not in df.columns]
    if bad:
        raise ReportError(
            f"unknown column(s) {', '.join(bad)}; valid: {', '.join(sorted(df.columns))}"
        )


def ok_runs(df: pd.DataFrame) -> pd.DataFrame:
    if "status" in df:
        df = df[df["status"].fillna("ok") == "ok"]
    return df


def overrides(run_dir: str) -> str:
    """An experiment run's overrides besides the keys its point's dir is named by: the sub-dir
    under that dir (conf/experiment/*.yaml `subdir`); "" for a run at its point's dir."""
    return str(run_dir).partition("/")[2]


CONFIG = ("model.", "hardware.", "workload.", "planner.", "executor.", "checkpoint")
REPEATS = ("workload.seed",)  # runs differing only here are repeats of one point: averaged
SHORT = {**AXES, "workload.n_batches": "n", "executor.name": ""}  # label names ("": value alone)


def _splits(s: pd.DataFrame, along: set[str]) -> list[str]:
    """The config keys that tell a system's runs apart, besides `along` and the repeats: each
    kept only if it splits the runs further than the keys before it (swept axes first), so an
    executor's own keys do not each repeat what executor.name says."""
    first = [c for c in AXES if c.startswith("workload.")] + ["workload.n_batches", "executor.name"]
    cols = [c for c in s.columns if c.startswith(CONFIG) and c not in along and c not in REPEATS]
    cols = sorted(cols, key=lambda c: (first.index(c) if c in first else len(first), c))
    keys: list[str] = []
    n = 1
    for c in cols:
        m = s.groupby([*keys, c], dropna=False, sort=False).ngroups
        if m > n:
            keys, n = [*keys, c], m
    return keys


def _value(c: str, v: Any) -> str:
    name = SHORT.get(c, c.rsplit(".", 1)[-1])
    shown = f"{v:g}" if isinstance(v, float | int) and not isinstance(v, bool) else str(v)
    return f"{name} {shown}".strip()


def _lines(g: pd.DataFrame, *along: str) -> list[tuple[str, pd.DataFrame]]:
    """One line per system and per value of each config key that tells its runs apart (a swept
    axis the line does not run `along`, a planner param, the executor, an experiment's other
    overrides), so only repeats of one config (other seeds) are averaged. An x axis of the
    runs' n (`n_batches`, what Klotski's planner chose) runs along the configured n too."""
    skip = set(along) | ({"workload.n_batches"} if "n_batches" in along else set())
    skip |= {"n_batches"}  # an output: Klotski at its own n picks one per batch size
    if "run_dir" in g.columns:  # runs without their config (older results): the sub-dir
        g = g.assign(_overrides=g["run_dir"].map(overrides))
    out = []
    for system, s in g.groupby(SYSTEM, sort=True):
        keys = _splits(s, skip)
        if not keys and "_overrides" in s and s["_overrides"].nunique() > 1:
            keys = ["_overrides"]
        parts = s.groupby(keys, dropna=False, sort=True) if keys else [((), s)]
        for key, part in parts:
            key = key if isinstance(key, tuple) else (key,)
            label = ", ".join(
                [
                    str(system),
                    *(
                        str(v) or "(no other override)" if c == "_overrides" else _value(c, v)
                        for c, v in zip(keys, key, strict=True)
                    ),
                ]
            )
            out.append((label, part.drop(columns=["_overrides"], errors="ignore")))
    return out


def idle_shares(d: pd.DataFrame) -> pd.DataFrame:
    """Each run's GPU idle seconds per cause (`IDLE`.<cause> columns) as shares of its makespan,
    causes named without the prefix, largest overall first; no columns where no run has them."""
    cols = [c for c in d.columns if c.startswith(IDLE + ".")]
    if not cols:  # runs from before the causes were recorded, or none feasible
        return pd.DataFrame(index=d.index)
    share = d[cols].fillna(0.0).div(d["makespan_s"].where(d["makespan_s"] > 0), axis=0).fillna(0.0)
    share.columns = [cause_of(c) for c in cols]
    return share[share.sum().sort_values(ascending=False).index]


def cause_of(column: str) -> str:
    """An idle cause as core.bubbles names it, from collect's column (`IDLE`.load_expert@h2d:
    `load expert@h2d`; op kinds and tensors have no `_`, so only the part before `@` had a space)."""
    name = column[len(IDLE) + 1 :]
    head, at, tail = name.partition("@")
    return head.replace("_", " ") + at + tail


# what each part of a cause's name means, for the words above the ranked table
_TENSORS = {"expert": "expert weights", "attention": "attention weights", "gate": "gate weights",
            "ffn": "dense FFN weights", "embed": "embedding weights", "head": "LM-head weights",
            "kv": "KV cache", "hidden": "a batch's hidden states (its activations)"}  # fmt: skip
_RESOURCES = {"h2d": "the host-to-GPU link", "d2h": "the GPU-to-host link", "disk": "disk reads",
              "disk_write": "disk writes", "p2p": "the GPU-to-GPU link", "p2p_out": "the GPU-to-GPU link",
              "d2d": "copies within GPU memory", "gpu": "the GPU", "cpu": "the CPU"}  # fmt: skip


def cause_meaning(cause: str) -> str:
    """A cause of core.bubbles in words: `load expert@h2d` -> expert weights crossing the
    host-to-GPU link; `load hidden@d2h` -> a batch's hidden states crossing the GPU-to-host link."""
    head, _, res = cause.partition("@")
    where = _RESOURCES.get(res, res)
    kind, _, what = head.partition(" ")
    if kind == "load" and res in ("disk", "disk_write"):
        return f"{_TENSORS.get(what, what or 'data')} {'read from' if res == 'disk' else 'written to'} disk"
    if kind == "load":
        return f"{_TENSORS.get(what, what or 'data')} crossing {where}"
    if kind in ("kv-load", "kv-store"):
        return f"the KV cache crossing {where}"
    if kind in ("dispatch", "combine"):
        return f"the all-to-all ({kind}) on {where}"
    if kind == "all-reduce":
        return f"an all-reduce on {where}"
    if kind.startswith("compute-"):
        part = kind.removeprefix("compute-")
        return (
            f"{part} compute on the CPU"
            if res == "cpu"
            else f"{part} compute of another GPU or lane"
        )
    if kind == "memory":
        return f"ops ready but waiting for {res} memory"
    if kind == "launch":
        return "kernel launches of lanes sharing the SMs"
    if kind == "late":
        return f"ops ready, {where} free, started late: the executor's own delay"
    return cause


def causes_text(shares: pd.Series, top: int = 3, at_least: float = 0.05) -> str:
    """The main causes of one run's bubble with their part of it: `load expert@h2d 96%, ...`."""
    total = float(shares.sum())
    if total <= 0:
        return "-"
    parts = shares[shares / total >= at_least].sort_values(ascending=False).head(top)
    return ", ".join(f"{c} {v / total:.0%}" for c, v in parts.items())


RANK = "throughput_tok_s"  # what the ranking orders by (higher is better)
# a sweep's point: the workload a run was given (Klotski's own n, `n_batches`, is its choice)
POINT = ["workload.batch_size", "workload.n_batches", "workload.prompt_len", "workload.gen_len"]


def ranking(df: pd.DataFrame) -> list[tuple[tuple[Any, ...], pd.DataFrame]]:
    """Per (model, hardware) panel, one row per line of the figures (a system, and whatever
    config tells its runs apart), at its best point of the sweep (repeats averaged), fastest
    first: its throughput, the leader's ratio over it, its bubble and what the bubble waits on;
    `wins` counts the points of the sweep where two or more lines ran and it was fastest."""
    d = ok_runs(df).dropna(subset=[RANK])
    shares = idle_shares(d)
    out = []
    for key, g in _panels(d):
        pts = [c for c in POINT if c in g.columns]
        g = g.assign(_point=g[pts].astype(str).agg(" ".join, axis=1) if pts else "")
        lines = _lines(g, *pts, "n_batches")
        rows, at_point = [], {}  # at_point: {point: [(throughput, line), ...]}
        for label, s in lines:
            mean = s.groupby("_point", sort=False)[RANK].mean()
            for point, v in mean.items():
                at_point.setdefault(point, []).append((v, label))
            runs = s[s["_point"] == mean.idxmax()]
            first = runs.iloc[0]
            rows.append(
                {
                    "planner": label,
                    "batch_size": first.get("workload.batch_size"),
                    "n": first.get("n_batches"),
                    RANK: float(runs[RANK].mean()),
                    "makespan_s": _mean(runs, "makespan_s"),
                    "gpu_bubble_frac": _mean(runs, "gpu_bubble_frac"),
                    WAITS: causes_text(shares.loc[runs.index].mean()) if not shares.empty else "-",
                    "runs": len(runs),
                }
            )
        t = pd.DataFrame(rows).sort_values(RANK, ascending=False, kind="stable")
        t.insert(0, "rank", range(1, len(t) + 1))
        t["leader_over_it"] = t[RANK].iloc[0] / t[RANK]
        winners = [max(v)[1] for v in at_point.values() if len(v) > 1]
        t["wins"] = [winners.count(label) for label in t["planner"]]
        t.attrs["points"] = len(winners)
        out.append((key, t.reset_index(drop=True)))
    return out


def _mean(runs: pd.DataFrame, column: str) -> float:
    return float(runs[column].mean()) if column in runs else float("nan")


def answer(key: tuple[Any, ...], t: pd.DataFrame) -> str:
    """The ranking of one panel in words (plain text): who wins, by how much over each other
    system, and what the winner's GPU bubble waits on."""
    w = t.iloc[0]
    where = f" on {' / '.join(map(str, key))}" if key else ""
    at = (
        f" (its best point: batch {int(w['batch_size'])}, n {int(w['n'])})"
        if pd.notna(w["batch_size"]) and pd.notna(w["n"])
        else ""
    )
    text = f"{w['planner']} has the highest throughput{where}, {w[RANK]:.2f} tok/s{at}"
    if len(t) == 1:
        text += ", the only system in this sweep."
    else:
        others = [
            f"{r['leader_over_it']:.2f}x {r['planner']} ({r[RANK]:.2f})"
            for _, r in t.iloc[1:].iterrows()
        ]
        text += ": " + ", ".join(others) + "."
        if t.attrs.get("points", 0) > 1:
            text += f" It is the fastest at {int(w['wins'])} of the {t.attrs['points']} points where two or more systems ran."
    causes = str(w[WAITS])
    if pd.isna(w["gpu_bubble_frac"]):
        return text
    if causes == "-":
        text += f" Its GPUs are idle {100 * w['gpu_bubble_frac']:.1f}% of the run" + (
            "." if w["gpu_bubble_frac"] > 0 else ": no bubble to explain."
        )
    else:
        top = causes.split(", ")[0].rsplit(" ", 1)
        text += (
            f" Its GPUs compute nothing {100 * w['gpu_bubble_frac']:.1f}% of the run, and that"
            f" bubble waits on {causes}: mostly {cause_meaning(top[0])}."
        )
    return text


def short_table(df: pd.DataFrame) -> str:
    """planner, n, throughput, makespan, GPU bubble %, the two efficiencies, and what the bubble
    waited for most (its share of the bubble): one line per run. eff = busiest-resource bound /
    makespan; dag = the schedule's own bound / makespan."""
    d = ok_runs(df)
    shares = idle_shares(d)
    lines = [
        f"{'planner':<20} {'model':<14} {'bs':>4} {'n':>4} {'tok/s':>10} {'makespan s':>11} {'bubble %':>9} {'eff':>6} {'dag':>6}  bubble waits on"
    ]
    for _, r in (d.sort_values("throughput_tok_s", ascending=False) if len(d) else d).iterrows():
        dag = r.get("dag_efficiency", float("nan"))
        # an experiment's run in a sub-dir of its point: the overrides that tell it apart
        where = overrides(r.get("run_dir", ""))
        where = f"  {where}" if where else ""
        lines.append(
            f"{r[SYSTEM]:<20} {r.get('model.name', ''):<14} {int(r['workload.batch_size']):>4} "
            f"{int(r['n_batches']):>4} {r['throughput_tok_s']:>10.2f} {r['makespan_s']:>11.2f} "
            f"{100 * r['gpu_bubble_frac']:>9.1f} {r['efficiency']:>6.3f} {dag:>6.3f}  "
            f"{top_cause(shares.loc[r.name].to_dict()):<20}{where}"
        )
    bad = df[df.get("status", pd.Series("ok", index=df.index)).fillna("ok") != "ok"]
    for _, r in bad.iterrows():
        lines.append(
            f"{r.get(SYSTEM, '?'):<20} infeasible at bs {r.get('workload.batch_size')}: {r.get('error', '')[:80]}"
        )
    return "\n".join(lines)


# ---- figures ------------------------------------------------------------------------------------


def _panels(df: pd.DataFrame) -> list[tuple[tuple[Any, ...], pd.DataFrame]]:
    keys = [k for k in PANEL if k in df.columns]
    if not keys:
        return [((), df)]
    return [(k if isinstance(k, tuple) else (k,), g) for k, g in df.groupby(keys, sort=True)]


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


def _line_figure(
    df: pd.DataFrame, x: str, metric: str, xlabel: str, title: str, path: Path, logx: bool = False
) -> bool:
    """One subplot per (model, hardware) panel, one line per system."""
    d = ok_runs(df).dropna(subset=[x, metric])
    panels = _panels(d)
    # a line needs two x values: the n a planner picked for itself is no line
    if d.empty or not any(s[x].nunique() > 1 for _, g in panels for _, s in _lines(g, x)):
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False)
    ends = []
    for ax, (key, g) in zip(axes[0], panels, strict=True):
        for i, (label, s) in enumerate(_lines(g, x)):
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
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fig_latency(df: pd.DataFrame, metric: str, path: Path) -> bool:
    """Throughput against the latency of a group (its makespan), one curve per system."""
    d = ok_runs(df).dropna(subset=["makespan_s", metric])
    if len(d) < 2:
        return False
    panels = _panels(d)
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.4), squeeze=False)
    ends = []
    for ax, (key, g) in zip(axes[0], panels, strict=True):
        for i, (label, s) in enumerate(_lines(g, "n_batches", "workload.batch_size")):
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
    for label, g in _lines(d):
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _pick_gantt_runs(df: pd.DataFrame) -> pd.DataFrame:
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
OP_COLORS = {"compute-attention": ("attention", "tab:blue"), "compute-gate": ("gate", "tab:purple"),
             "compute-expert": ("expert", "tab:green"), "compute-ffn": ("dense FFN", "tab:olive"),
             "compute-head": ("head", "tab:gray"), "load": ("load", "tab:orange"),
             "kv-load": ("kv load", "tab:cyan"), "kv-store": ("kv store", "tab:pink")}  # fmt: skip


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
        trace = pd.read_parquet(sweep / r["run_dir"] / "trace.parquet")
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
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _per_layer_figure(df: pd.DataFrame, column: str, ylabel: str, title: str, path: Path) -> bool:
    if column not in df.columns:
        return False
    d = ok_runs(df).dropna(subset=[column])
    if d.empty:
        return False
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, g in _lines(d):  # every run (one per system and swept point)
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
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- page -----------------------------------------------------------------------------------------


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
    if SYSTEM not in df.columns and "planner.name" in df.columns:  # results of an older collect
        df = df.assign(**{SYSTEM: df["planner.name"]})
    problems = problems or []
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
    columns = columns or []
    check_request(df, metric, columns)
    out.mkdir(parents=True, exist_ok=True)
    figs: list[tuple[str, str, str]] = []  # (file, title, caption)
    notes: list[str] = []
    mlabel = METRIC_LABELS.get(metric, metric)

    def add(ok: bool, name: str, title: str, caption: str, why: str) -> None:
        if ok:
            figs.append((name, title, caption))
        else:
            notes.append(f"{title}: not drawn ({why}).")

    up = "the highest" if metric not in LOWER_IS_BETTER else "the lowest"
    add(
        _line_figure(
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
        f"Klotski Fig. 10's shape, one line per system. Read: {up} line at a batch size is the best "
        "system there; a line that stops short ran out of memory at the next size (the runs table "
        "lists infeasible runs).",
        "no system ran at two or more batch sizes",
    )
    add(
        fig_latency(df, metric, out / "throughput_vs_latency.png"),
        "throughput_vs_latency.png",
        f"{mlabel} vs latency",
        "Klotski Fig. 11's shape: each point is a run, its latency the time to finish a group of n "
        "batches; a system's runs at several batch sizes or n are joined."
        + (
            " Read: up and to the left is better; a point above and left of another beats it on both."
            if metric == "throughput_tok_s"
            else ""
        ),
        "fewer than two runs",
    )
    add(
        _line_figure(
            df,
            "n_batches",
            metric,
            "n (batches per group)",
            f"{mlabel} vs n",
            out / "throughput_vs_n.png",
        ),
        "throughput_vs_n.png",
        f"{mlabel} vs n",
        "n is how many batches share each weight load. Read: a line still rising at its right end is "
        "still bound by weight loads there; where it flattens, compute or memory binds instead.",
        "no system ran at two or more n",
    )
    add(
        fig_idle_causes(df, out / "idle_causes.png"),
        "idle_causes.png",
        "Where the GPU bubbles come from",
        "Each bar is a run, fastest first; its length is the share of the run its GPUs computed "
        "nothing (the mean over its GPUs), split by the op each idle gap waited for, walked back "
        "along the gap's critical chain. Read: the longest segment is what to shorten first. Names "
        "are kind@resource: load expert@h2d is expert weights crossing the host-to-GPU link, load "
        "hidden@h2d / @d2h a batch's hidden states (its activations) crossing it, as a CPU expert's "
        "input and output do; kv-load / kv-store the KV cache; dispatch@p2p the all-to-all; "
        "compute-...@gpu another GPU's (or lane's) work, compute-...@cpu work on the CPU; "
        "memory@tier an op ready but waiting for memory; launch kernel launches; late@resource an "
        "op ready with its resource free that started late all the same (the executor's own delay).",
        "no run's GPUs idled, or the runs predate gpu_idle_causes_s",
    )
    runs = _pick_gantt_runs(df)
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
    add(
        _per_layer_figure(
            df,
            "plan.prefetch_accuracy_per_layer",
            "prefetch accuracy (useful / prefetched)",
            "Prefetch accuracy per MoE layer",
            out / "prefetch_accuracy.png",
        ),
        "prefetch_accuracy.png",
        "Prefetch accuracy per layer",
        "Share of the experts a planner prefetched that the gate then asked for, per MoE layer. "
        "Read: a layer well below the others is where the predictor misses, and each miss is a load "
        "the GPU waits on.",
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
        and _per_layer_figure(
            bal,
            "_balancedness",
            "balancedness (mean / max device tokens)",
            "Balancedness per MoE layer",
            out / "load_balance.png",
        ),
        "load_balance.png",
        "Balancedness per MoE layer",
        "Expert-parallel runs: the mean over the max of the devices' tokens, per MoE layer. Read: 1 "
        "is an even load; a line below another leaves its busiest GPU more work, so its layers "
        "take longer.",
        "no expert-parallel run in this sweep",
    )
    write_results(df, out)
    page = out / "index.html"
    page.write_text(_html(sweep, df, figs, notes, problems, columns))
    return page


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
            "tok/s": "{:.2f}".format,
            "makespan s": "{:.2f}".format,
            ratio: "{:.2f}x".format,
            "GPU bubble": lambda v: f"{100 * v:.1f}%",
        }
        shown = t.drop(columns=["runs", *(["wins"] if t.attrs.get("points", 0) < 2 else [])])
        names["wins"] = f"fastest at (of {t.attrs.get('points', 0)} points)"
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
    table = runs_table(df, columns).to_html(
        index=False, float_format=lambda v: f"{v:.4g}", na_rep="-", border=0
    )
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>moepipe report: {e(sweep.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:13px}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
        ".note{color:#555}.answer{font-size:17px;line-height:1.4}</style></head><body>",
        f"<h1>moepipe report: {e(str(sweep))}</h1>",
        "<h2>Who wins</h2>",
        *_answer_html(df),
        f"<p>{len(df)} run(s) collected; simulated unless marked real. Data: results.parquet / results.csv.</p>",
    ]
    for name, title, caption in figs:
        parts.append(
            f"<h2>{e(title)}</h2><img src='{e(name)}' alt='{e(title)}'><p class='note'>{e(caption)}</p>"
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
    loaded = load_sweep(sweep_dir)
    if loaded is None:
        return 2
    df, problems = loaded
    try:  # one line for a folder that cannot be made, the default <sweep>/report too
        output_dir(str(opts.out or sweep_dir / "report"), "out")
        page = write_report(
            sweep_dir,
            Path(opts.out) if opts.out else None,
            opts.metric,
            [str(c) for c in opts.columns],
            df=df,
            problems=problems,
        )
    except (ReportError, MoepipeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a full disk while the figures are written: the error names no file
        out = opts.out or sweep_dir / "report"
        print(f"error: out={out}: cannot write the report ({err.strerror or err})", file=sys.stderr)
        return 2
    print(f"report: {page}")
    return 0


_app = command("report", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(run_command(main))
