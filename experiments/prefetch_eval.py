"""Evaluate the expert prefetch predictors (planners/prefetch.py) on ESFT routing they did not
train on: the table is built from the `train` tasks, then groups of `group_seqs` test sequences
are replayed position by position (a decode step of a batch group), the table updated online.
It prints the tables; with `out=FILE.csv` it also writes the per-layer table there.

Per layer pair (l-1 -> l) and overall, as in Klotski Fig. 13 (paper: 100%, 58.89%, 42.24%):
  used     fraction of prefetched experts the group used
  hot      fraction of prefetched experts that are truly the group's top-K
  single   single-sequence accuracy: a token's own top-K prediction vs its own top-k set

Usage:
    python -m experiments.prefetch_eval train=[law,summary,translation] test=[intent] [out=x.csv]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from core.args import written_whole
from core.errors import MoepipeError, integer_below
from core.files import cannot_write
from core.traces import load_esft, select_tokens
from experiments.common.app import command
from experiments.common.cli import (
    checked_names,
    exit_command,
    output_file,
)
from experiments.common.dir_lock import output_locked
from experiments.common.held_warnings import plan_accepted, say_line
from experiments.common.path_values import comma_in_name
from experiments.common.tables import markdown  # noqa: E402
from planners.prefetch import ExpertTable, Predictor, top_k


def sequences(trace, tasks: tuple[str, ...]) -> list[np.ndarray]:  # type: ignore[no-untyped-def]
    """[P, L, k] expert ids of each sequence of the tasks, in order."""
    idx = select_tokens(trace, tasks, ())
    key = trace.seq_key[idx]
    cuts = np.flatnonzero(key[1:] != key[:-1]) + 1
    return [trace.expert_ids[part].astype(np.int64) for part in np.split(idx, cuts)]


def evaluate(
    table: ExpertTable, test: list[np.ndarray], kind: str, k: int, group_seqs: int
) -> pd.DataFrame:
    """Rows (layer, used, hot, single, n) summed over groups; the predictor learns online."""
    from tqdm import tqdm

    pred = Predictor(kind, table, k)
    n_layers, n_experts = table.shape
    acc = np.zeros((n_layers, 4))  # used, hot, single, groups
    # a bar on stderr, a tick per group (group_seqs=1 on a whole task runs for minutes): the
    # table goes to stdout, untouched
    starts = range(0, len(test), group_seqs)
    bar = tqdm(
        starts,
        desc=f"prefetch_eval {kind}",
        unit="group",
        file=sys.stderr,
        mininterval=1.0,
        dynamic_ncols=True,
        leave=False,
        disable=None,  # off a terminal (a pipe, a log): nothing added to stderr
    )
    for g0 in bar:
        group = test[g0 : g0 + group_seqs]
        for pos in range(max(len(s) for s in group)):
            ids = np.stack(
                [s[pos] for s in group if pos < len(s)]
            )  # [B, L, k] one token per sequence
            for layer in range(n_layers):
                prev = ids[:, layer - 1] if layer else None
                cur = ids[:, layer]
                counts = np.bincount(cur.ravel(), minlength=n_experts)
                guess = pred.predict(layer, prev, counts)
                if guess:
                    acc[layer, 0] += np.mean([counts[e] > 0 for e in guess])
                    acc[layer, 1] += len(set(guess) & set(top_k(counts.astype(float), k))) / k
                acc[layer, 2] += single_sequence(pred, layer, prev, cur, k)
                acc[layer, 3] += 1
                pred.observe(layer, prev, cur)
    df = pd.DataFrame(acc[:, :3] / acc[:, 3:], columns=["used", "hot", "single"])
    df.insert(0, "layer", range(n_layers))
    return df


def single_sequence(
    pred: Predictor, layer: int, prev: np.ndarray | None, cur: np.ndarray, k: int
) -> float:
    """Mean over tokens of |own top-K prediction ∩ own top-k| / k."""
    if pred.kind == "oracle":
        return 1.0
    table = pred.table
    assert table is not None
    if pred.kind == "popularity" or layer == 0 or prev is None:
        guess = np.array(top_k(table.marginal[layer], k))
        return float(np.mean([len(set(guess) & set(row)) / k for row in cur]))
    rows = table.pair[layer] / np.maximum(table.pair[layer].sum(1, keepdims=True), 1.0)
    votes = rows[prev].sum(1)  # [T, E]
    order = np.argsort(-votes, axis=1, kind="stable")[:, :k]
    return float(np.mean([len(set(o) & set(c)) / k for o, c in zip(order, cur, strict=True)]))


@dataclass
class Options:
    train: list[str] = field(default_factory=lambda: ["law", "summary", "translation"])  # tasks
    test: list[str] = field(default_factory=lambda: ["intent"])  # tasks, unseen in training
    trace_dir: str = "../shared/traces"
    group_seqs: int = 32  # sequences per batch group (n x bs)
    k: int = 0  # experts prefetched; 0 = the trace's top-k
    out: str = ""  # CSV of the per-layer table


def main(argv: list[str] | None = None) -> int:
    return _app(argv)


def _main(args: Options) -> int:
    if not str(args.out).strip():
        return _evaluated(args)
    try:
        with output_locked(args.out, "out", "prefetch_eval"):  # two at once: the last won
            return _evaluated(args)
    except MoepipeError as e:
        say_line(e)
        return 2


def _check_tasks(flag: str, tasks: tuple[str, ...], trace: Any, trace_dir: str) -> None:
    """`train` or `test` (`flag`), the trace's tasks named: none, an unknown one (or one split
    at its comma), one given twice or one the trace holds no tokens of is a MoepipeError."""
    if not tasks:  # an empty list selects every task, the other side's too
        raise MoepipeError(
            f"{flag}=[]: name at least one task (of {', '.join(trace.task_names)}); "
            "an empty list would select every task, the other list's too"
        )
    unknown = [t for t in tasks if t not in trace.task_names]
    split = comma_in_name(flag, tasks, trace.task_names) if unknown else None
    if split is not None:  # one task's name, split at its comma
        raise split
    if unknown:
        raise MoepipeError(
            f"{flag}=[{','.join(tasks)}]: unknown task(s) {unknown}; pass tasks the "
            f"trace has: {', '.join(trace.task_names)}"
        )
    checked_names(flag, tasks, trace.task_names)  # one given twice: its rows doubled
    held = {trace.task_names[i] for i in np.unique(trace.task)}
    if empty := [t for t in tasks if t not in held]:  # a trace cut to some tasks
        raise MoepipeError(
            f"{flag}=[{','.join(tasks)}]: the trace in {trace_dir} holds no tokens "
            f"of {', '.join(empty)}; name tasks it holds ({', '.join(sorted(held))})"
        )


def _evaluated(args: Options) -> int:
    try:
        if args.group_seqs < 1:
            raise MoepipeError(
                integer_below("group_seqs", args.group_seqs, 1, "sequences per group")
                + "; pass group_seqs=1 or more"
            )
        if args.k < 0:
            raise MoepipeError(
                integer_below("k", args.k, 0, "0 = the trace's top-k") + "; pass k=0 or more"
            )
        if args.out:  # checked before the evaluation, whose table would be lost after
            output_file(args.out, "out", ".csv", starts=b"layer,")
        trace = load_esft(args.trace_dir, trace_dir_flag="trace_dir")
        train, test = tuple(map(str, args.train)), tuple(map(str, args.test))
        for flag, tasks in (("train", train), ("test", test)):
            _check_tasks(flag, tasks, trace, args.trace_dir)
        if set(train) & set(test):
            raise MoepipeError(
                f"train={list(train)} and test={list(test)} overlap; drop "
                f"{sorted(set(train) & set(test))} from one of them (evaluate on unseen tasks)"
            )
        train_ids = np.concatenate([s for s in sequences(trace, train)])  # [T, L, k]
        table = ExpertTable.fit(train_ids, trace.expert_ids.max() + 1, f"ESFT {','.join(train)}")
        test_seqs = sequences(trace, test)
        if args.group_seqs > len(test_seqs):
            raise MoepipeError(
                f"group_seqs={args.group_seqs}: exceeds the {len(test_seqs)} sequences of "
                f"test={list(test)}; pass group_seqs <= {len(test_seqs)} (one group of them all)"
            )
        n_experts = int(trace.expert_ids.max()) + 1
        if args.k > n_experts:
            raise MoepipeError(
                f"k={args.k}: exceeds the trace's {n_experts} experts; pass k <= {n_experts}"
            )
    except MoepipeError as e:
        say_line(e)
        return 2
    plan_accepted()  # inputs accepted: its warnings said now, not as it ends
    k = args.k or trace.expert_ids.shape[-1]
    res = {
        kind: evaluate(table, test_seqs, kind, k, args.group_seqs)
        for kind in ("correlation", "popularity")
    }
    df = res["correlation"].merge(res["popularity"], on="layer", suffixes=("_corr", "_pop"))
    df["hot_gain"] = df["hot_corr"] - df["hot_pop"]
    pairs = df[df.layer > 0]
    print(
        f"train {','.join(train)} -> test {','.join(test)}: {len(test_seqs)} sequences, groups of "
        f"{args.group_seqs}, K={k}; layer l = pair (l-1 -> l); table updated online"
    )
    print(markdown(df, index=False))
    mean = pairs.mean()
    print(
        f"\noverall (layer pairs): used {mean.used_corr:.1%} (popularity {mean.used_pop:.1%}), "
        f"hot {mean.hot_corr:.1%} (popularity {mean.hot_pop:.1%}), "
        f"single-sequence {mean.single_corr:.1%} "
        f"(popularity {mean.single_pop:.1%}); paper: 100%, 58.89%, 42.24%"
    )
    print(
        "correlation beats popularity (hot) on "
        f"{(pairs.hot_gain > 0).sum()}/{len(pairs)} layer pairs"
    )
    return _write(df, args.out) if args.out else 0


def _write(df: pd.DataFrame, out: str) -> int:
    """The table to `out`, whole or not there (a full disk cut it short); the exit status."""
    try:
        with written_whole(out) as tmp:
            df.to_csv(tmp, index=False)
    except OSError as e:
        say_line(cannot_write(f"out={out}", e))
        return 2
    return 0


_app = command("prefetch_eval", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
