"""The replication report's plots (PNG) and its page (report.txt and index.html with the
plots, each with its caption). Each takes the report's rows (`experiments.common.ep_rows`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from core.args import PNG_METADATA, refuse_their_png, refuse_theirs
from core.errors import MoepipeError
from experiments.common.ep_rows import plotted_batches
from experiments.common.run_dir import atomic_write_text

# how each file the report writes begins: one that begins otherwise is another's (a user's page,
# experiments.report's), which the report would lose
PAGE_START = b"<!doctype html><html><head><meta charset='utf-8'><title>moepipe replication</title>"
REPORT_STARTS = (b"case ", b"dispatch=")  # report.txt: the table, or the dispatch note above it


def batch_balance(phases: pd.DataFrame) -> pd.Series:
    """Balancedness of each batch (its steps together) from a balance.csv table: its layers'
    mean device tokens over their max, summed as `core.balance` sums a run."""
    g = phases.groupby("batch")
    return g["mean_tokens"].sum() / g["max_tokens"].sum()


def target_corner(at: Sequence[dict[str, Any]]) -> tuple[float, float] | None:
    """Where a planner meets both of a case's targets at one batch size, from its rows `at`:
    (eplb's balancedness, the makespan in ms that closes half the ep_static -> oracle gap).
    None where one of the three did not run or the oracle is not faster than ep_static."""
    by = {r["planner"]: r for r in at}
    if not {"ep_static", "eplb", "oracle_replication"} <= by.keys():
        return None
    st, orc = by["ep_static"]["makespan_s"], by["oracle_replication"]["makespan_s"]
    if orc >= st:
        return None
    return float(by["eplb"]["balancedness"]), 1e3 * (st - 0.5 * (st - orc))


def plot_trade_off(
    rows: list[dict[str, Any]], out: Path, judged: Mapping[str, int | None]
) -> Path | None:
    """Balancedness against makespan, one point per planner and variant, one panel per target
    case at its judged batch: the two targets pull apart where copies cost time, and the shaded
    corner (at least eplb's balancedness, at most the makespan that closes half the gap) is
    where a planner meets both. None if no target case ran."""
    import matplotlib.pyplot as plt

    shown = plotted_batches([r for r in rows if r["case"] in judged], judged)
    if not shown:
        return None
    # one colour and marker per planner or variant in every panel, named once in a legend below
    # (labels written beside the points overlapped where several sit near the oracle)
    labels = list(
        dict.fromkeys(
            r["planner_label"]
            for r in rows
            if r["case"] in shown and r["batch_size"] == shown[r["case"]]
        )
    )
    colours = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # a ListedColormap
    style = {lab: (colours[i % len(colours)], "os^Dv<>PX*"[i % 10]) for i, lab in enumerate(labels)}
    ncol = min(len(shown), len(labels))  # about one column of labels per 4.5-inch panel
    legend_in = 0.22 * -(-len(labels) // ncol)  # inches: one legend row per ncol labels
    fig, axes = plt.subplots(
        1, len(shown), figsize=(4.5 * len(shown), 3.6 + legend_in), squeeze=False
    )
    for ax, (case, bs) in zip(axes[0], shown.items(), strict=True):
        at = [r for r in rows if r["case"] == case and r["batch_size"] == bs]
        for r in at:
            colour, marker = style[r["planner_label"]]
            ax.plot(
                1e3 * r["makespan_s"],
                r["balancedness"],
                marker=marker,
                color=colour,
                linestyle="none",
                label=r["planner_label"],
            )
        corner = target_corner(at)
        if corner is not None:
            bal, ms = corner
            ax.axhline(bal, color="grey", linewidth=0.6, linestyle="--")
            ax.axvline(ms, color="grey", linewidth=0.6, linestyle="--")
            ax.fill_between([ax.get_xlim()[0], ms], bal, 1.0, color="green", alpha=0.08)
        fresh = " (fresh)" if judged.get(case) == bs else ""
        ax.set(title=f"{case} bs={bs}{fresh}", xlabel="makespan (ms)", ylabel="balancedness")
    handles = [plt.Line2D([], [], color=c, marker=mk, linestyle="none") for c, mk in style.values()]
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0.0, legend_in / (3.6 + legend_in), 1.0, 1.0))
    path = out / "balance_vs_makespan.png"
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def plot(
    rows: list[dict[str, Any]],
    out: Path,
    sweep: Path,
    judged: Mapping[str, int | None] | None = None,
) -> list[Path]:
    """Balancedness and expert-phase utilisation per layer, balancedness per batch (each case
    at the batch its targets are judged on, `judged`: a held-out case's fresh batch; else its
    largest; read from each run's balance.csv under `sweep`), and throughput against batch
    size; one panel per case, PNGs in `out`."""
    from experiments.common.mpl_quiet import agg

    agg()
    judged = judged or {}
    shown = plotted_batches(rows, judged)
    title = {
        c: f"{c} bs={bs}" + (" (fresh)" if judged.get(c) == bs else "") for c, bs in shown.items()
    }
    colour = colours(rows)
    paths = [
        _per_layer(rows, out, metric, shown, title, colour)
        for metric in ("balancedness_per_layer", "expert_phase_util_per_layer")
    ]
    paths.append(_per_batch(rows, out, sweep, shown, title, colour))
    paths.append(_throughput(rows, out, colour))
    trade = plot_trade_off(rows, out, judged)
    return paths + ([trade] if trade else [])


def colours(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One colour per planner or variant in every panel (the default cycle repeats after 10 and
    restarts per panel: a 12-row case drew two oracle variants in ep_static's and eplb's)."""
    import matplotlib.pyplot as plt

    palette = plt.get_cmap("tab20").colors  # type: ignore[attr-defined]  # a ListedColormap
    return {
        lab: palette[i % len(palette)]
        for i, lab in enumerate(dict.fromkeys(r["planner_label"] for r in rows))
    }


def _panels(rows: list[dict[str, Any]]) -> tuple[Any, Any, list[str]]:
    import matplotlib.pyplot as plt

    cases = sorted({r["case"] for r in rows})
    fig, axes = plt.subplots(1, len(cases), figsize=(4 * len(cases), 3.2), squeeze=False)
    return fig, axes, cases


def _save(fig: Any, axes: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt

    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:  # a panel with no rows draws no legend
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata=PNG_METADATA)
    plt.close(fig)
    return path


def _per_layer(
    rows: list[dict[str, Any]],
    out: Path,
    metric: str,
    shown: Mapping[str, int],
    title: Mapping[str, str],
    colour: Mapping[str, Any],
) -> Path:
    fig, axes, cases = _panels(rows)
    for ax, case in zip(axes[0], cases, strict=True):
        for r in rows:
            if r["case"] == case and r["batch_size"] == shown[case]:
                per = r[metric]
                ax.plot(
                    [int(k) for k in per],
                    list(per.values()),
                    marker=".",
                    color=colour[r["planner_label"]],
                    label=r["planner_label"],
                )
        ax.set(
            title=title[case],
            xlabel="layer",
            ylabel=metric.removesuffix("_per_layer"),
            ylim=(0, 1.02),
        )
    return _save(fig, axes, out / f"{metric}.png")


def _per_batch(
    rows: list[dict[str, Any]],
    out: Path,
    sweep: Path,
    shown: Mapping[str, int],
    title: Mapping[str, str],
    colour: Mapping[str, Any],
) -> Path:
    fig, axes, cases = _panels(rows)
    for ax, case in zip(axes[0], cases, strict=True):  # per batch, from each run's balance.csv
        for r in rows:
            path = sweep / r["run_dir"] / "balance.csv"
            if r["case"] == case and r["batch_size"] == shown[case] and path.exists():
                per = batch_balance(pd.read_csv(path))
                ax.plot(
                    per.index,
                    per.values,
                    marker=".",
                    label=r["planner_label"],
                    color=colour[r["planner_label"]],
                )
        ax.set(
            title=title[case],
            xlabel="batch (prefill iteration)",
            ylabel="balancedness",
            ylim=(0, 1.02),
        )
    return _save(fig, axes, out / "balancedness_per_batch.png")


def _throughput(rows: list[dict[str, Any]], out: Path, colour: Mapping[str, Any]) -> Path:
    fig, axes, cases = _panels(rows)
    for ax, case in zip(axes[0], cases, strict=True):
        for planner in dict.fromkeys(r["planner"] for r in rows):  # the four, then any variants
            mine = [r for r in rows if r["case"] == case and r["planner"] == planner]
            if not mine:
                continue
            pts = sorted(
                (
                    r["batch_size"],
                    r["batch_size"] * r["n_batches"] * r["prompt_len"] / r["makespan_s"],
                )
                for r in mine
            )
            ax.plot(
                *zip(*pts, strict=True),
                marker="o",
                label=planner,
                color=colour[mine[0]["planner_label"]],
            )
        ax.set(
            title=case,
            xlabel="batch size (sequences)",
            ylabel="prompt tokens / s",  # not generated: a run's throughput_tok_s
            xscale="log",
            yscale="log",
        )
    return _save(fig, axes, out / "throughput.png")


CAPTIONS = {  # each plot's caption on the report page
    "balancedness_per_layer.png": "Balancedness (mean / max device tokens) per MoE layer, each "
    "case at the batch its targets are judged on (a held-out case's fresh batch), "
    "else its largest.",
    "expert_phase_util_per_layer.png": "Expert-phase utilisation per MoE layer: expert busy time "
    "over the devices' expert-phase spans.",
    "balancedness_per_batch.png": "Balancedness of each batch (prefill iteration).",
    "throughput.png": "Throughput against batch size, every planner and variant.",
    "balance_vs_makespan.png": "Balancedness against makespan for the target cases: the shaded "
    "corner (at least eplb's balancedness, at most the makespan that closes half the "
    "ep_static -> oracle gap) is where a planner meets both targets.",
}


def write_pages(out: Path, lines: list[str], pngs: list[Path]) -> Path:
    """out/report.txt (the printed lines) and out/index.html (those lines and this run's plots,
    each with its caption), both replaced whole; returns the page's path."""
    import html

    body = "\n".join(
        f'<figure><img src="{p.name}" alt="{p.stem}"><figcaption>'
        f"{html.escape(CAPTIONS.get(p.name, p.stem))}</figcaption></figure>"
        for p in pngs
    )
    page = (
        PAGE_START.decode() + "<style>body{font-family:sans-serif;margin:2em}pre{font-size:12px}"
        "img{max-width:100%}</style></head><body><h1>Expert replication (issue 5)</h1>"
        f"<pre>{html.escape(chr(10).join(lines))}</pre>\n{body}\n</body></html>\n"
    )
    for name, text in (("report.txt", "\n".join(lines) + "\n"), ("index.html", page)):
        atomic_write_text(out / name, text)
    return out / "index.html"


def refuse_others(out: Path) -> None:
    """A MoepipeError naming `out` where a file the report writes there (its page, report.txt,
    a plot) is a folder or a file the report did not write: checked before anything is read or
    written, so that nothing of the user's is lost."""
    starts = {"index.html": PAGE_START, "report.txt": REPORT_STARTS}
    for name in ["index.html", "report.txt", *CAPTIONS]:
        path = out / name
        if path.is_dir():
            raise MoepipeError(
                f"out={path}: a folder, where the report writes its {name}; pass out= another "
                "folder, or move that one away first"
            )
        if name in starts:
            refuse_theirs(path, "out", starts[name])
        else:
            refuse_their_png(path, "out")
