"""Turn a sweep into a static HTML report with PNG figures (readable offline).

Figures: throughput vs batch size per system; throughput vs latency; throughput vs n; what the
GPUs' idle time waited for, per run (core.bubbles); a Gantt timeline of one layer per planner
with GPU bubbles shaded (sim, and real above it where a real trace exists); prefetch accuracy per
layer; load balance per layer (replication runs). A figure whose data the sweep lacks is left out
with a note saying why.

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
from core.routing import peek_suffix  # noqa: E402
from experiments.app import command  # noqa: E402
from experiments.cli import until_interrupted  # noqa: E402
from experiments.collect import collect, load_sweep, write_results  # noqa: E402

SYSTEM = "system"  # collect's: the planner config choice (planner.name in older results)
# swept workload columns: a figure against one of them draws a line per value of the others
AXES = {"workload.batch_size": "bs", "n_batches": "n", "workload.prompt_len": "prompt",
        "workload.gen_len": "gen"}  # fmt: skip
PANEL = ("model.name", "hardware.name")
METRIC_LABELS = {
    "throughput_tok_s": "throughput (tokens/s)",
    "makespan_s": "makespan (s)",
    "gpu_bubble_frac": "GPU bubble (fraction of makespan)",
    "efficiency": "efficiency (busiest-resource bound / makespan)",
    "dag_efficiency": "efficiency (the schedule's own bound / makespan)",
    "gpu_bubble_s": "GPU bubble (s)",
}
SYSTEM_NAMES = {  # the system each planner models (anchors.md)
    "sequential": "Accelerate (sequential)",
    "layer_prefetch": "layer prefetch",
    "flexgen": "FlexGen",
    "zero_inference": "ZeRO-Inference",
    "moe_infinity": "MoE-Infinity",
    "fiddler": "Fiddler",
    "mixtral_offloading": "mixtral-offloading",
    "klotski": "Klotski",
    "klotski_at_n": "Klotski (n given)",
    "klotski_hot": "Klotski, hot prefetch only",
    "klotski_multi": "Klotski, multi-batch only",
}
IDLE = "gpu_idle_causes_s"  # summary.json's {cause: seconds}, flattened by collect to IDLE.<cause>
IDLE_SHOWN = 7  # causes a figure names; the rest are drawn as one "other"
TABLE_COLUMNS = [SYSTEM, "executor.name", "workload.batch_size", "n_batches", "throughput_tok_s", "makespan_s",
                 "gpu_bubble_frac", "efficiency", "dag_efficiency"]  # fmt: skip


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


def _label(planner: str) -> str:
    suffix = peek_suffix(planner)
    name = planner[: len(planner) - len(suffix)]
    return SYSTEM_NAMES.get(name, name) + suffix


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
            label = ", ".join([_label(str(system)),
                               *(str(v) or "(no other override)" if c == "_overrides" else _value(c, v)
                                 for c, v in zip(keys, key, strict=True))])  # fmt: skip
            out.append((label, part.drop(columns=["_overrides"], errors="ignore")))
    return out


def idle_shares(d: pd.DataFrame) -> pd.DataFrame:
    """Each run's GPU idle seconds per cause (`IDLE`.<cause> columns) as shares of its makespan,
    causes named without the prefix, largest overall first; no columns where no run has them."""
    cols = [c for c in d.columns if c.startswith(IDLE + ".")]
    if not cols:  # runs from before the causes were recorded, or none feasible
        return pd.DataFrame(index=d.index)
    share = d[cols].fillna(0.0).div(d["makespan_s"].where(d["makespan_s"] > 0), axis=0).fillna(0.0)
    share.columns = [c[len(IDLE) + 1 :] for c in cols]
    return share[share.sum().sort_values(ascending=False).index]


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


def _line_figure(df: pd.DataFrame, x: str, metric: str, xlabel: str, title: str, path: Path,
                 logx: bool = False) -> bool:  # fmt: skip
    """One subplot per (model, hardware) panel, one line per system."""
    d = ok_runs(df).dropna(subset=[x, metric])
    if d.empty or d[x].nunique() < 2:
        return False
    panels = _panels(d)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, (key, g) in zip(axes[0], panels, strict=True):
        for label, s in _lines(g, x):
            s = s.groupby(x, as_index=False)[metric].mean().sort_values(x)  # repeats of a point
            ax.plot(s[x], s[metric], marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.set_title(" / ".join(map(str, key)) or title, fontsize=10)
        if logx:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted(g[x].unique()), [str(int(v)) for v in sorted(g[x].unique())])
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def fig_latency(df: pd.DataFrame, metric: str, path: Path) -> bool:
    """Throughput against the latency of a group (its makespan), one curve per system."""
    d = ok_runs(df).dropna(subset=["makespan_s", metric])
    if len(d) < 2:
        return False
    panels = _panels(d)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4), squeeze=False)
    for ax, (key, g) in zip(axes[0], panels, strict=True):
        for label, s in _lines(g, "n_batches", "workload.batch_size"):
            s = s.sort_values("makespan_s")
            ax.plot(s["makespan_s"], s[metric], marker="o", label=label)
        ax.set_xlabel("latency: makespan of a group of n batches (s)")
        ax.set_ylabel(METRIC_LABELS.get(metric, metric))
        ax.set_xscale("log")
        ax.set_title(" / ".join(map(str, key)), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    what = METRIC_LABELS.get(metric, metric).split(" (")[0]
    fig.suptitle(f"{what[0].upper()}{what[1:]} vs latency (each point: one batch size / n)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
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
    names, rows = [], []
    for label, g in _lines(d):
        for idx, r in g.iterrows():
            names.append(label + (f", bs {int(r['workload.batch_size'])}, n {int(r['n_batches'])}"
                                  if len(g) > 1 else ""))  # fmt: skip
            rows.append(share.loc[idx].to_numpy())
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
    return sel.drop_duplicates(by).sort_values(by)


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
            ax.barh(i, (b - a) * 1e3, left=(a - t0) * 1e3, color=colors.get(str(r["kind"]), "k"),
                    alpha=alpha, edgecolor="none", height=0.7)  # fmt: skip
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
                items.append((f"{_label(str(r[SYSTEM]))} ({source}, bs {r.get('workload.batch_size')}, "
                              f"n {r.get('n_batches')})", t))  # fmt: skip
    if not items:
        return False
    fig, axes = plt.subplots(len(items), 1, figsize=(11, 1.2 + 1.6 * len(items)), squeeze=False)
    for ax, (title, t) in zip(axes[:, 0], items, strict=True):
        _gantt_axis(ax, t, title)
    from matplotlib.patches import Patch

    handles = [
        Patch(color=c, label=k) for k, c in (*OP_COLORS.values(), ("GPU bubble", (1, 0, 0, 0.25)))
    ]
    fig.suptitle("One layer per planner (lighter: ops of other layers in the same window; red: GPU idle)",
                 fontsize=10)  # fmt: skip
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


def write_report(sweep_dir: str | Path, out_dir: str | Path | None = None, metric: str = "throughput_tok_s",
                 columns: list[str] | None = None, df: pd.DataFrame | None = None,
                 problems: list[str] | None = None) -> Path:  # fmt: skip
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

    add(_line_figure(df, "workload.batch_size", metric, "batch size (sequences)", f"{mlabel} vs batch size",
                     out / "throughput_vs_batch.png", logx=True),
        "throughput_vs_batch.png", f"{mlabel} vs batch size", "Klotski Fig. 10 shape: one line per system.",
        "the sweep has one batch size")  # fmt: skip
    add(
        fig_latency(df, metric, out / "throughput_vs_latency.png"),
        "throughput_vs_latency.png",
        f"{mlabel} vs latency",
        "Klotski Fig. 11 shape"
        + (": up and to the left is better." if metric == "throughput_tok_s" else "."),
        "fewer than two runs",
    )
    add(_line_figure(df, "n_batches", metric, "n (batches per group)", f"{mlabel} vs n",
                     out / "throughput_vs_n.png"),
        "throughput_vs_n.png", f"{mlabel} vs n", "Batches sharing each weight load.", "the sweep has one n")  # fmt: skip
    add(fig_idle_causes(df, out / "idle_causes.png"), "idle_causes.png", "Where the GPU bubbles come from",
        "Each run's idle GPU time (the mean over its GPUs) split by the op its idle gaps waited "
        "for, walked back along each gap's critical chain: kind@resource (load expert@h2d a weight "
        "transfer, dispatch@p2p the all-to-all, compute-...@gpu another GPU's work), memory@tier "
        "(ready, waiting for memory), launch, late@resource (ready, resource free, started late: the "
        "executor's own delay).",
        "no run's GPUs idled, or the runs predate gpu_idle_causes_s")  # fmt: skip
    runs = _pick_gantt_runs(df)
    add(fig_gantt(sweep, runs, out / "gantt.png") if not runs.empty else False, "gantt.png",
        "Timeline of one layer", "From trace.parquet; rows are streams, red spans are GPU bubbles.",
        "no run has a trace.parquet")  # fmt: skip
    add(_per_layer_figure(df, "plan.prefetch_accuracy_per_layer", "prefetch accuracy (useful / prefetched)",
                          "Prefetch accuracy per MoE layer", out / "prefetch_accuracy.png"),
        "prefetch_accuracy.png", "Prefetch accuracy per layer",
        "Share of prefetched experts the gate then asked for.", "no run records prefetch accuracy")  # fmt: skip
    # expert-parallel runs' balancedness_per_layer ({MoE layer: mean/max device tokens}, which
    # collect flattens to one column a layer) as one list a run
    per_layer = sorted((c for c in df.columns if c.startswith("balancedness_per_layer.")),
                       key=lambda c: int(c.rsplit(".", 1)[1]))  # fmt: skip
    bal = df.assign(_balancedness=df[per_layer].to_numpy().tolist()) if per_layer else df
    add(bool(per_layer) and _per_layer_figure(bal, "_balancedness", "balancedness (mean / max device tokens)",
                                              "Balancedness per MoE layer", out / "load_balance.png"),
        "load_balance.png", "Balancedness per MoE layer",
        "Expert-parallel runs: mean over max tokens of the devices, per MoE layer (1 = even).",
        "no expert-parallel run in this sweep")  # fmt: skip
    write_results(df, out)
    page = out / "index.html"
    page.write_text(_html(sweep, df, figs, notes, problems, columns))
    return page


def _html(sweep: Path, df: pd.DataFrame, figs: list[tuple[str, str, str]], notes: list[str],
          problems: list[str], columns: list[str]) -> str:  # fmt: skip
    cols = [
        c
        for c in (*TABLE_COLUMNS[:1], *PANEL, *TABLE_COLUMNS[1:], *columns, "status")
        if c in df.columns
    ]
    table = (
        df[cols]
        .sort_values([c for c in cols if c in (*PANEL, SYSTEM, "executor.name", *AXES)])
        .to_html(index=False, float_format=lambda v: f"{v:.4g}", na_rep="-", border=0)
    )
    e = html.escape
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>moepipe report: {e(sweep.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}img{max-width:100%}"
        "table{border-collapse:collapse;font-size:13px}td,th{padding:2px 8px;border-bottom:1px solid #ddd}"
        ".note{color:#555}</style></head><body>",
        f"<h1>moepipe report: {e(str(sweep))}</h1>",
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
    parts.append(f"<h2>Runs</h2>{table}</body></html>")
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
        page = write_report(sweep_dir, Path(opts.out) if opts.out else None, opts.metric,
                            [str(c) for c in opts.columns], df=df, problems=problems)  # fmt: skip
    except (ReportError, MoepipeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"report: {page}")
    return 0


_app = command("report", Options, _main, __doc__)

if __name__ == "__main__":
    sys.exit(main())
