"""The replication report's rows, read from a collected sweep table, and its verdict lines: the
runs table, the balancedness, makespan-gap and utilisation targets (experiments.replication and
experiments.replication_cv print them)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from core.errors import MoepipeError
from experiments.common.tables import fixed

# row label order within a case and batch: the four the targets compare, then the variants
ROW_ORDER = ("ep_static", "eplb", "predictive_replication", "oracle_replication")
COUNTS = (
    "batch_size",
    "n_batches",
    "prompt_len",
    "n_devices",
    "copies",
    "interval",
    "micro_batches",
    "split_tokens",
)


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted keys -> nested dicts (collect's columns back into a run's summary layout); a
    count that a missing value made a float column is an int again."""
    out: dict[str, Any] = {}
    for key, v in flat.items():
        if _missing(v):
            continue
        parts = key.split(".")
        if parts[-1] in COUNTS and isinstance(v, float) and v.is_integer():
            v = int(v)
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                break
        else:
            node[parts[-1]] = v
    return out


def rows_of(df: pd.DataFrame, one_setting: bool = True) -> list[dict[str, Any]]:
    """One row per replication run of the table (those with a `case`), in the layout the lines
    read: `case`, `planner` (a variant's label, else the planner), `planner_label` (its display
    name), `batch_size`, `prompt_len`, `model`, per-layer dicts keyed by layer, and the
    summary's metrics as they were (`plan.ep.copies` -> r["plan"]["ep"]["copies"]).
    `one_setting`: refuse two runs of one (case, batch, row) (`check_one_setting`)."""
    rows = []
    for rec in df.to_dict("records"):
        r = unflatten(rec)
        if not r.get("case") or r.get("status", "ok") != "ok":
            continue
        r["params"] = r["planner"].get("params", {})
        r["planner"] = str(r.get("variant") or r["planner"]["name"])
        r["planner_label"] = str(r.pop("system"))
        r["batch_size"] = int(r["workload"]["batch_size"])
        r["prompt_len"] = int(r["workload"]["prompt_len"])
        r["model"] = str(r["model"]["name"])
        for key in ("balancedness_per_layer", "expert_phase_util_per_layer"):
            per = r.get(key, {})
            r[key] = {k: per[k] for k in sorted(per, key=int)}
        # largest first, as the summary holds them; `load expert@h2d` as core.bubbles names it
        # (collect's column names have no spaces: load_expert@h2d)
        causes = r.get("gpu_idle_causes_s", {})
        r["gpu_idle_causes_s"] = {
            (f"load {k[5:]}" if k.startswith("load_") else k): v
            for k, v in sorted(causes.items(), key=lambda kv: -kv[1])
        }
        rows.append(r)
    if one_setting:
        check_one_setting(rows)
    return rows


def check_one_setting(rows: list[dict[str, Any]]) -> None:
    """A sweep folder holding two runs of one (case, batch, row), e.g. after a sweep with
    replication.split=validation into the same folder: one line, not a mixed report."""
    seen: dict[tuple[str, int, str], str] = {}
    for r in rows:
        key = (r["case"], r["batch_size"], r["planner"])
        if key in seen:
            raise MoepipeError(
                f"{r['run_dir']} and {seen[key]} are runs of {key[0]} bs={key[1]} {key[2]} "
                "with other settings; sweep each setting into its own hydra.sweep.dir and pass "
                "that as dir="
            )
        seen[key] = r["run_dir"]


def order_rows(rows: list[dict[str, Any]], cases: Sequence[str], labels: Sequence[str]) -> list:
    """Rows by case (in `cases`' order, others after by name), batch size, then row label (the
    four planners, then `labels`' order, then any other by name)."""
    case_at = {c: i for i, c in enumerate(cases)}
    label_at = {lab: i for i, lab in enumerate([*ROW_ORDER, *labels])}
    return sorted(
        rows,
        key=lambda r: (
            case_at.get(r["case"], len(case_at)),
            r["case"],
            r["batch_size"],
            label_at.get(r["planner"], len(label_at)),
            r["planner"],
        ),
    )


def case_shapes(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Case -> what its runs share: routing, prompt_len, n_batches, the batch sizes that ran and
    (held-out ESFT) the split's tokens; in the rows' order."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        c = out.setdefault(
            r["case"],
            {
                "routing": r["replication"]["routing"],
                "prompt_len": r["prompt_len"],
                "n_batches": r["n_batches"],
                "split_tokens": r.get("split_tokens"),
                "batch_sizes": [],
            },
        )
        if r["batch_size"] not in c["batch_sizes"]:
            c["batch_sizes"].append(r["batch_size"])
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """prompt_tok/s = the prompt tokens of the run's batches over its makespan (a replication
    case generates one token: a run's throughput_tok_s, generated tokens, is prompt_len times
    fewer); balanced = mean/max device tokens (vLLM); util = mean device compute busy / makespan;
    load = the time a kernel runs on a GPU / makespan (GPUtil's load: the paper's metric; lanes
    are one GPU; on GPUs the all-to-all's kernels count); phase = expert busy / (G x expert-phase
    spans): the token view and three time views. late_ms = the most one device's experts waited for
    replica copies still in flight (`core.balance.copy_waits`): 0 where every copy was prefetched in
    time."""
    w = max([16, *(len(r["case"]) for r in rows)])
    pw = max([42, *(len(r["planner_label"]) for r in rows)])
    head = (
        f"{'case':{w}} {'bs':>4} {'planner':{pw}} {'makespan_ms':>11} {'prompt_tok/s':>12} "
        f"{'balanced':>8} "
        f"{'util':>6} {'load':>6} {'phase':>6} {'copies':>6} {'late_ms':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['case']:{w}} {r['batch_size']:>4} {r['planner_label']:{pw}} "
            f"{fixed(1e3 * r['makespan_s']):>11} "
            f"{r['batch_size'] * r['n_batches'] * r['prompt_len'] / r['makespan_s']:>12.0f} "
            f"{r['balancedness']:>8.3f} {r['utilisation']:>6.3f} "
            f"{r.get('gpu_load', float('nan')):>6.3f} {r['expert_phase_util']:>6.3f} "
            f"{r['plan']['ep'].get('copies', 0):>6} {1e3 * r.get('copy_wait_s', 0.0):>7.3f}"
        )
    return "\n".join(lines)


NOISE_GAP = 0.01  # an ep_static -> oracle gap below this share of ep_static's makespan is noise


def gap_line(
    case: str,
    bs: int,
    st: dict[str, Any],
    pr: dict[str, Any],
    orc: dict[str, Any],
    who: str = "predictive",
    seen: str = "",
    verdict: bool = True,
) -> str:
    """Share of the ep_static -> oracle makespan gap `who` closes; in words when there is no gap
    to close (the oracle is not faster than ep_static), never nan. `seen` follows the batch
    size; verdict=False tags the line [note] instead of PASS / FAIL. A gap under NOISE_GAP of
    ep_static's makespan is not judged ([n/a ]): a share of 0.3% says nothing about replication."""

    def tag(ok: bool | None) -> str:
        return ("n/a " if ok is None else "PASS" if ok else "FAIL") if verdict else "note"

    ms = {k: 1e3 * r["makespan_s"] for k, r in (("st", st), ("pr", pr), ("orc", orc))}
    times = f"(ep_static {ms['st']:.2f} ms, oracle {ms['orc']:.2f} ms, {who} {ms['pr']:.2f} ms)"
    gap = st["makespan_s"] - orc["makespan_s"]
    if gap <= 0:
        return (
            f"[{tag(False)}] {case} bs={bs}{seen}: no gap to close: "
            "the oracle is not faster than ep_static "
            f"{times}; {who} is {'faster' if ms['pr'] < ms['st'] else 'not faster'} than "
            f"ep_static"
        )
    if gap < NOISE_GAP * st["makespan_s"]:
        return (
            f"[{tag(None)}] {case} bs={bs}{seen}: the oracle is only {gap / st['makespan_s']:.2%} "
            f"faster than ep_static {times}: a gap under {NOISE_GAP:.0%} is noise, not judged; "
            f"{who} is {'faster' if ms['pr'] < ms['st'] else 'not faster'} than ep_static"
        )
    closed = (st["makespan_s"] - pr["makespan_s"]) / gap
    # a share just under half must not print as "50%" beside a FAIL
    shown = f"{closed:.0%}"
    if closed < 0.5 and shown == "50%":
        shown = f"{closed:.2%}" if f"{closed:.2%}" != "50.00%" else "49.99%"  # under 49.995%
    return (
        f"[{tag(closed >= 0.5)}] {case} bs={bs}{seen}: {who} closes {shown} of "
        f"the ep_static -> oracle makespan gap {times}; target >= 50%"
    )


def digits_apart(a: float, b: float) -> int:
    """Decimals that print `a` and `b` apart (at least 4), so a verdict on a < b never stands
    beside equal figures; 4 where they are equal."""
    return next((k for k in range(4, 17) if f"{a:.{k}f}" != f"{b:.{k}f}"), 4)


def fresh_batch(case: Any, split_tokens: int) -> int | None:
    """The largest of a held-out case's batch sizes whose batches together need no more tokens
    than the split holds, so no token runs twice (`esft_routing` wraps the stream beyond): the
    online learners (predictive's window, eplb's) have then seen none of a batch's sequences.
    None if every batch size wraps."""
    per_run = int(case["prompt_len"]) * int(case["n_batches"])
    fits = [int(bs) for bs in case["batch_sizes"] if int(bs) * per_run <= split_tokens]
    return max(fits) if fits else None


def targets(
    rows: list[dict[str, Any]],
    cases: list[str],
    variants: Sequence[str] = (),
    fresh: Mapping[str, int | None] | None = None,
) -> list[str]:
    """The issue's targets: balancedness and makespan gap of predictive (and of each variant) on
    each of `cases` at its `fresh` batch (held-out ESFT cases: `fresh_batch`, no sequence seen
    before, also not online; others: their largest), and utilisation, in each of its three time
    views, wherever ep_static is below 0.6. The case's largest batch, where it is another, is shown
    beside as a note: there the stream revisits the split, so from its second batch on the online
    learners have seen every token they are judged on. A case with no fresh batch is judged at its
    largest, and its lines say it revisits."""
    out, notes = [], []
    fresh = fresh or {}
    for who in ("predictive_replication", *variants):
        name = "predictive" if who == "predictive_replication" else who
        for case in cases:
            largest = max(r["batch_size"] for r in rows if r["case"] == case)
            judged = fresh.get(case) or largest
            for bs in dict.fromkeys((judged, largest)):
                by = {r["planner"]: r for r in rows if r["case"] == case and r["batch_size"] == bs}
                lack = [p for p in ("ep_static", "eplb", "oracle_replication", who) if p not in by]
                if lack:
                    out.append(
                        f"[n/a ] {case} bs={bs}: {name} not judged: {', '.join(lack)} did not run"
                    )
                    continue
                st, ep, orc, pr = by["ep_static"], by["eplb"], by["oracle_replication"], by[who]
                revisits = case in fresh and bs != fresh[case]  # held-out ESFT, wrapped
                seen = " (revisits held-out tokens)" if revisits else ""
                ok = pr["balancedness"] >= ep["balancedness"]
                d = digits_apart(pr["balancedness"], ep["balancedness"])
                bal = (
                    f"{case} bs={bs}{seen}: {name} balancedness {pr['balancedness']:.{d}f} "
                    f"{'>=' if ok else '<'} eplb {ep['balancedness']:.{d}f}"
                )
                gap = gap_line(case, bs, st, pr, orc, name, seen, verdict=bs == judged)
                if bs == judged:
                    out += [f"[{'PASS' if ok else 'FAIL'}] {bal}", gap]
                else:  # the largest batch beside the judged one, not a verdict
                    notes += [f"[note] {bal}", gap]
    out += notes
    for metric, what in (
        ("expert_phase_util", "expert-phase utilisation"),
        ("utilisation", "whole-run utilisation (busy/makespan)"),
        ("gpu_load", "GPU load (GPUtil's, the paper's)"),
    ):
        out += utilisation_lines(rows, metric, what)
    return out


def utilisation_lines(rows: list[dict[str, Any]], metric: str, what: str) -> list[str]:
    """The utilisation target on one metric: every case where ep_static is below 0.6 and the best
    replication planner's figure (target >= 0.9), or why the premise never arises. Where even
    the oracle's replicas stay below 0.9, the line says so: the idle time there is not
    imbalance that replication can remove (e.g. dense work on device 0 at batch 1).
    Runs compare within one layout (`_layout`): a variant run as micro-batches (two-batch
    overlap) against ep_static's variant run so, whose overlap lifts its utilisation too."""
    out = []
    for r in rows:
        base = r["planner"] == "ep_static" or (
            r.get("variant_of") == "ep_static" and _layout(r)[2] > 1
        )
        if not base or r[metric] >= 0.6:
            continue
        same = [
            x
            for x in rows
            if x["case"] == r["case"]
            and x["batch_size"] == r["batch_size"]
            and _layout(x) == _layout(r)
        ]
        # replication planners and their variants (not ep_static's, not the oracle's)
        rep = [
            x
            for x in same
            if x.get("variant_of", x["planner"]) in ("eplb", "predictive_replication")
        ]
        if not rep:
            continue
        best = max(rep, key=lambda x: x[metric])
        bound = [
            x[metric] for x in same if x.get("variant_of", x["planner"]) == "oracle_replication"
        ]
        why = f"; the oracle upper bound reaches {bound[0]:.3f}" if bound and bound[0] < 0.9 else ""
        out.append(
            f"[{'PASS' if best[metric] >= 0.9 else 'FAIL'}] "
            f"{r['case']} bs={r['batch_size']}{_setting(r)}: {what} "
            f"{r['planner']} {r[metric]:.3f} < 0.6 -> "
            f"{best['planner']} {best[metric]:.3f} (target >= 0.9{why})"
        )
        if best[metric] < 0.9:
            out.append("       " + idle_text(best))
    if not out:
        low = min((r for r in rows if r["planner"] == "ep_static"), key=lambda r: r[metric])
        out.append(
            f"[n/a ] {what}: no case has ep_static below 0.6 (lowest {low[metric]:.3f}, "
            f"{low['case']} bs={low['batch_size']})"
        )
    return out


def idle_text(r: dict[str, Any], shown: int = 4) -> str:
    """What a run's GPUs waited for while they computed nothing (core.bubbles: its summary's
    gpu_idle_causes_s), as shares of its makespan, the largest first."""
    causes = r.get("gpu_idle_causes_s", {})
    if not causes:
        return f"{r['planner']}: its summary has no gpu_idle_causes_s"
    span = r["makespan_s"]
    top = ", ".join(f"{k} {v / span:.1%}" for k, v in list(causes.items())[:shown])
    rest = sum(list(causes.values())[shown:]) / span
    return (
        f"{r['planner']}'s GPUs computed nothing {sum(causes.values()) / span:.1%} of the run, "
        f"waiting on {top}" + (f", other {rest:.1%}" if rest > 0.0005 else "")
    )


def _layout(r: dict[str, Any]) -> tuple[int, bool, int]:
    """A run's devices as its utilisation depends on them: (G, lanes, micro-batches)."""
    ep = r.get("plan", {}).get("ep", {})
    return (ep.get("n_devices", 0), bool(ep.get("lanes")), ep.get("micro_batches", 1))


def _setting(r: dict[str, Any]) -> str:
    """What the devices of a run are, where it matters to read its utilisation: G GPUs, or G
    lanes of one GPU that partition its SMs or share them."""
    ep = r.get("plan", {}).get("ep", {})
    if not ep:
        return ""
    if not ep.get("lanes"):
        micro = ep.get("micro_batches", 1)
        tbo = f", {micro} micro-batches overlapped" if micro > 1 else ""
        return f" ({ep['n_devices']} GPUs{tbo})"
    how = "sharing its SMs" if ep.get("lane_sharing") == "shared" else "each 1/G of its SMs"
    return f" ({ep['n_devices']} lanes of one GPU, {how})"


def plotted_batches(rows: list[dict[str, Any]], judged: Mapping[str, int | None]) -> dict[str, int]:
    """Case -> the batch size its per-layer and per-batch panels show: the batch its targets are
    judged on (`judged`, where that ran), else its largest."""
    out = {}
    for case in sorted({r["case"] for r in rows}):
        ran = {int(r["batch_size"]) for r in rows if r["case"] == case}
        bs = judged.get(case)
        out[case] = bs if bs in ran else max(ran)
    return out
