"""The report's reading of a sweep: which runs are feasible, the lines a figure draws, what the
GPU bubbles wait on, and the ranking that answers who wins and by how much (the report page's
first section and the end-of-sweep table).

Usage:
    short_table(df)            # the ranked table a sweep prints when it ends
    ranking(df), answer(k, t)  # per (model, hardware) panel: the table and the sentence
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from core.bubbles import top_cause
from core.errors import did_you_mean
from core.shown import short_of
from experiments.common.path_values import comma_in_name
from experiments.common.tables import SYSTEM, fixed

# swept workload columns: a figure against one of them draws a line per value of the others
AXES = {
    "workload.batch_size": "bs",
    "n_batches": "n",
    "workload.prompt_len": "prompt",
    "workload.gen_len": "gen",
}
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
TABLE_COLUMNS = [
    SYSTEM,
    "executor.name",
    "workload.batch_size",
    "n_batches",
    "throughput_tok_s",
    "makespan_s",
    "gpu_bubble_frac",
    WAITS,
    "efficiency",
    "dag_efficiency",
]


class ReportError(ValueError):
    """A bad report request (unknown metric or column); the message lists the valid ones."""


def numeric_columns(df: pd.DataFrame) -> list[str]:
    """The columns a figure can draw as a metric: numbers, not true/false (has_trace, a flag),
    which pandas counts as numeric and a figure drew as 0 and 1."""
    types = pd.api.types
    return sorted(
        c
        for c in df.columns
        if types.is_numeric_dtype(df[c]) and not types.is_bool_dtype(df[c]) and df[c].notna().any()
    )


# summary.json keys every report reads (its table, ranking and figures), whatever the request
REQUIRED = ("throughput_tok_s", "makespan_s", "n_batches")


def check_request(df: pd.DataFrame, metric: str, columns: list[str]) -> None:
    missing = [k for k in REQUIRED if k not in df.columns or df[k].isna().all()]
    if missing:
        raise ReportError(
            f"no run's summary.json holds {', '.join(missing)}; the summaries were not written by "
            "experiments.run (or by another version): run the sweep again"
        )
    valid_metrics = numeric_columns(df)
    if metric not in valid_metrics:
        # the list names what the runs measured: a config key (hardware.n_gpus) or a flag
        # (skip_finished) is taken, but is no metric to offer
        measured = [c for c in valid_metrics if not c.startswith(CONFIG)]
        said = (
            f"metric {metric!r} is a column of {_kind(df[metric])}, not of numbers a figure draws; "
            if metric in df.columns
            else f"unknown metric {metric!r}; {did_you_mean(metric, valid_metrics)}"
        )
        raise ReportError(
            f"{said}"
            f"the runs' metrics: {', '.join(measured)} (a "
            "numeric config key, e.g. model.top_k, is taken too)"
        )
    bad = [c for c in columns if c not in df.columns]
    split = comma_in_name("columns", columns, set(df.columns)) if bad else None
    if split is not None:  # a column's name, split at its comma
        raise ReportError(str(split))
    if bad:
        raise ReportError(
            f"unknown column(s) {', '.join(bad)}; {did_you_mean(bad[0], df.columns)}"
            f"valid: {', '.join(sorted(df.columns))}"
        )


def _kind(col: pd.Series) -> str:
    """What a column that is no metric holds, in words."""
    present = col.dropna()
    if present.empty:
        return "no values"
    return "true/false" if all(isinstance(v, bool | np.bool_) for v in present) else "text"


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
    kept if it splits the runs further than the keys before it (swept axes first), or holds
    two values of its own (not set and one value: an executor's own keys do not each repeat
    what executor.name says)."""
    first = [c for c in AXES if c.startswith("workload.")] + ["workload.n_batches", "executor.name"]
    cols = [c for c in s.columns if c.startswith(CONFIG) and c not in along and c not in REPEATS]
    cols = sorted(cols, key=lambda c: (first.index(c) if c in first else len(first), c))
    keys: list[str] = []
    n = 1
    for c in cols:
        m = s.groupby([*keys, c], dropna=False, sort=False).ngroups
        if m > n:
            keys, n = [*keys, c], m
    # a key that splits no further but holds two values (model.n_layers, where each gen_len's
    # runs had their own) is named too: a label by gen_len alone hid that the models differ
    return keys + [c for c in cols if c not in keys and s[c].dropna().nunique() > 1]


def _value(c: str, v: Any) -> str:
    name = SHORT.get(c, c.rsplit(".", 1)[-1])
    shown = f"{v:g}" if isinstance(v, float | int) and not isinstance(v, bool) else str(v)
    return f"{name} {shown}".strip()


def line_groups(g: pd.DataFrame, *along: str) -> list[tuple[str, pd.DataFrame]]:
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
    `load expert@h2d`; op kinds and tensors have no `_`, so only the part before `@` had a space).
    """
    name = column[len(IDLE) + 1 :]
    head, at, tail = name.partition("@")
    return head.replace("_", " ") + at + tail


# what each part of a cause's name means, for the words above the ranked table
_TENSORS = {
    "expert": "expert weights",
    "attention": "attention weights",
    "gate": "gate weights",
    "ffn": "dense FFN weights",
    "embed": "embedding weights",
    "head": "LM-head weights",
    "kv": "KV cache",
    "hidden": "a batch's hidden states (its activations)",
}
_RESOURCES = {
    "h2d": "the host-to-GPU link",
    "d2h": "the GPU-to-host link",
    "disk": "disk reads",
    "disk_write": "disk writes",
    "p2p": "the GPU-to-GPU link",
    "p2p_out": "the GPU-to-GPU link",
    "d2d": "copies within GPU memory",
    "gpu": "the GPU",
    "cpu": "the CPU",
}


def cause_meaning(cause: str) -> str:
    """A cause of core.bubbles in words: `load expert@h2d` -> expert weights crossing the
    host-to-GPU link; `load hidden@d2h` -> a batch's hidden states crossing the GPU-to-host link."""
    head, _, res = cause.partition("@")
    where = _RESOURCES.get(res, res)
    kind, _, what = head.partition(" ")
    if kind == "load" and res in ("disk", "disk_write"):
        return (
            f"{_TENSORS.get(what, what or 'data')} "
            f"{'read from' if res == 'disk' else 'written to'} disk"
        )
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
    return ", ".join(f"{c} {short_of(v / total, '.0%', 0, 1)}" for c, v in parts.items())


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
    for key, g in panel_groups(d):
        pts = [c for c in POINT if c in g.columns]
        # str of each value: pandas' str dtype keeps a missing key (a run of other code) as NaN
        g = g.assign(
            _point=g[pts].astype(object).apply(lambda r: " ".join(map(str, r)), axis=1)
            if pts
            else ""
        )
        lines = line_groups(g, *pts, "n_batches")
        rows, at_point = [], {}  # at_point: {point: [(throughput, line), ...]}
        for label, s in lines:
            mean = s.groupby("_point", sort=False)[RANK].mean()
            for point, v in mean.items():
                at_point.setdefault(point, []).append((v, label))
            # the first of the points that tie for its best (in the sweep's order), not the one
            # its last bits favour
            best = [point for point, v in mean.items() if tied(v, mean.max())]
            runs = s[s["_point"] == best[0]]
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
                    "tied_points": len(best) - 1,
                }
            )
        t = pd.DataFrame(rows)
        t.insert(0, "rank", ranks(t[RANK].tolist()))
        t = t.sort_values(["rank", "planner"], kind="stable")  # a tie in name order, not noise
        t["leader_over_it"] = t[RANK].iloc[0] / t[RANK]
        firsts = [fastest(v) for v in at_point.values() if len(v) > 1]
        t["wins"] = [sum(label in f for f in firsts) for label in t["planner"]]
        t["tied_wins"] = [sum(label in f and len(f) > 1 for f in firsts) for label in t["planner"]]
        t.attrs["points"] = len(firsts)
        out.append((key, t.reset_index(drop=True)))
    return out


# throughputs this close are one: two schedules of the same times, summed in another order,
# differ by 1e-16 of their value, and a ranking by that noise would name a winner of a tie
TIE = 1e-9


def tied(a: float, b: float) -> bool:
    return abs(a - b) <= TIE * max(abs(a), abs(b))


def times(ratio: float) -> str:
    """The leader's ratio over a line: 1.00x only for a tie, else with the digits that set it
    off 1 (1.0002x: the leader is faster, if by little)."""
    return "1.00x" if tied(ratio, 1.0) else f"{short_of(ratio, '.2f', 1)}x"


def ranks(values: list[float]) -> list[int]:
    """Each value's rank, highest first, tied values sharing the best rank (1, 1, 3)."""
    return [1 + sum(w > v and not tied(w, v) for w in values) for v in values]


def fastest(at_point: list[tuple[float, str]]) -> list[str]:
    """The lines fastest at one point of the sweep: more than one where they tie."""
    top = max(v for v, _ in at_point)
    return sorted(label for v, label in at_point if tied(v, top))


def _mean(runs: pd.DataFrame, column: str) -> float:
    return float(runs[column].mean()) if column in runs else float("nan")


def _point_of(r: pd.Series) -> str:
    """A ranked line's best point in words ("" where its runs do not record it)."""
    if pd.isna(r["batch_size"]) or pd.isna(r["n"]):
        return ""
    k = int(r.get("tied_points", 0))
    also = f", tied at {k} other point{'s' if k > 1 else ''}" if k else ""
    return f"batch {int(r['batch_size'])}, n {int(r['n'])}{also}"


def _leaders(t: pd.DataFrame, where: str) -> str:
    """Who has the highest throughput: the one line, or the lines that tie for it."""
    top = t[t["rank"] == 1]
    w = top.iloc[0]
    if len(top) == 1:
        at = f" (its best point: {_point_of(w)})" if _point_of(w) else ""
        return f"{w['planner']} has the highest throughput{where}, {fixed(w[RANK])} tok/s{at}"
    names = ", ".join(top["planner"].iloc[:-1]) + f" and {top['planner'].iloc[-1]}"
    ats = "; ".join(f"{r['planner']} at {_point_of(r)}" for _, r in top.iterrows() if _point_of(r))
    return f"{names} tie for the highest throughput{where}, {fixed(w[RANK])} tok/s" + (
        f" ({ats})" if ats else ""
    )


def _wins(t: pd.DataFrame) -> str:
    """At how many of the sweep's points the leading line (or each tied one) is fastest."""
    points, top = t.attrs.get("points", 0), t[t["rank"] == 1]
    if points < 2:
        return ""
    if len(top) > 1:
        each = ", ".join(f"{r['planner']} {int(r['wins'])}" for _, r in top.iterrows())
        return f" Fastest, ties included, at: {each} of the {points} points where two or more ran."
    w = top.iloc[0]
    tie = f", tied at {int(w['tied_wins'])} of them" if w["tied_wins"] else ""
    return (
        f" It is the fastest at {int(w['wins'])} of the {points} points "
        f"where two or more systems ran{tie}."
    )


def answer(key: tuple[Any, ...], t: pd.DataFrame) -> str:
    """The ranking of one panel in words (plain text): who wins (the lines that tie, where
    they do), by how much over each other system, and what the winner's GPU bubble waits on."""
    w = t.iloc[0]
    text = _leaders(t, f" on {' / '.join(map(str, key))}" if key else "")
    rest = t[t["rank"] > 1]
    if len(t) == 1:
        text += ", the only system in this sweep."
    else:
        others = [
            f"{times(r['leader_over_it'])} {r['planner']} ({fixed(r[RANK])})"
            for _, r in rest.iterrows()
        ]
        text += (": " + ", ".join(others) if others else "") + "." + _wins(t)
    its = "Its" if len(rest) == len(t) - 1 else f"{w['planner']}'s"
    causes = str(w[WAITS])
    if pd.isna(w["gpu_bubble_frac"]):
        return text
    if causes == "-":
        text += f" {its} GPUs are idle {bubble_pct(w['gpu_bubble_frac'])}% of the run" + (
            "." if w["gpu_bubble_frac"] > 0 else ": no bubble to explain."
        )
    else:
        top = causes.split(", ")[0].rsplit(" ", 1)
        text += (
            f" {its} GPUs compute nothing {bubble_pct(w['gpu_bubble_frac'])}% of the run, and that"
            f" bubble waits on {causes}: mostly {cause_meaning(top[0])}."
        )
    return text


def bubble_pct(frac: float) -> str:
    """A GPU bubble's share of the run in percent, 1 decimal: 100.0 only where the GPU never
    computed, 0.0 only where it never idled (99.96% reads 99.96)."""
    return short_of(100 * frac, ".1f", 0, 100)


def short_table(df: pd.DataFrame) -> str:
    """planner, n, throughput, makespan, GPU bubble %, the two efficiencies, and what the bubble
    waited for most (its share of the bubble): one line per run. eff = busiest-resource bound /
    makespan; dag = the schedule's own bound / makespan."""
    d = ok_runs(df)
    shares = idle_shares(d)
    lines = [
        f"{'planner':<20} {'model':<14} {'bs':>4} {'n':>4} {'tok/s':>10} {'makespan s':>11} "
        f"{'bubble %':>9} {'eff':>6} {'dag':>6}  bubble waits on"
    ]
    for _, r in (d.sort_values("throughput_tok_s", ascending=False) if len(d) else d).iterrows():
        dag = r.get("dag_efficiency", float("nan"))
        # an experiment's run in a sub-dir of its point: the overrides that tell it apart
        where = overrides(r.get("run_dir", ""))
        where = f"  {where}" if where else ""
        lines.append(
            f"{r[SYSTEM]:<20} {r.get('model.name', ''):<14} {int(r['workload.batch_size']):>4} "
            f"{int(r['n_batches']):>4} {fixed(r['throughput_tok_s']):>10} "
            f"{fixed(r['makespan_s']):>11} "
            f"{bubble_pct(r['gpu_bubble_frac']):>9} {short_of(r['efficiency'], '.3f', 0, 1):>6} "
            f"{short_of(dag, '.3f', 0, 1):>6}  "
            f"{top_cause(shares.loc[r.name].to_dict()):<20}{where}"
        )
    bad = df[df.get("status", pd.Series("ok", index=df.index)).fillna("ok") != "ok"]
    for _, r in bad.iterrows():
        lines.append(
            f"{r.get(SYSTEM, '?'):<20} infeasible at bs {r.get('workload.batch_size')}: "
            f"{r.get('error', '')[:80]}"
        )
    return "\n".join(lines)


def panel_groups(df: pd.DataFrame) -> list[tuple[tuple[Any, ...], pd.DataFrame]]:
    keys = [k for k in PANEL if k in df.columns]
    if not keys:
        return [((), df)]
    return [(k if isinstance(k, tuple) else (k,), g) for k, g in df.groupby(keys, sort=True)]
