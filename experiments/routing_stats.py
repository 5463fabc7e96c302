"""Routing statistics of the real ESFT trace beside the fitted synthetic generator's, and the
Mixtral generator fitted to the OLMoE repository's aggregate Mixtral counts.

Prints both tables and writes them (with the fitted parameters) to routing_stats.json.

Usage:
    python -m experiments.routing_stats [trace_dir=../shared/traces] [out=routing_stats.json] \\
        [seed=0]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.args import written_whole
from core.errors import MoepipeError
from core.files import cannot_write
from core.routing_stats import routing_stats, stats_of
from core.synthetic import fit_synthetic, fit_to_counts, generate, headline
from core.traces import N_EXPERTS, N_LAYERS, TOP_K, load_counts, load_esft
from experiments.common.app import command
from experiments.common.cli import (
    as_int,
    exit_command,
    output_file,
    until_interrupted,
)
from experiments.common.dir_lock import output_locked
from experiments.common.held_warnings import plan_accepted, say_line

ROWS = (
    "max_over_mean_median",
    "top25pct_share_median",
    "prev_token_reuse",
    "top1_acc",
    "top1_in_next_set",
    "set_recall",
)


def esft_comparison(trace_dir: str, seed: int) -> dict[str, Any]:
    trace = load_esft(trace_dir, trace_dir_flag="trace_dir")
    real = routing_stats(
        trace.expert_ids, trace.gate_weights, N_EXPERTS, trace.seq_key, trace.seq_id % 5 == 0
    )
    if "top1_acc" not in real:  # its successor predictors need tokens of both splits
        raise MoepipeError(
            f"trace_dir={trace_dir}: the ESFT trace has {real['tokens']} token(s), "
            f"{real['train_tokens']} to train on and {real['test_tokens']} held out "
            "(seq_id % 5 == 0): too few to fit the generator's layer_corr, which then kept its "
            "start value; rebuild it from the whole dump (python -m experiments.convert_traces)"
        )
    fit = fit_synthetic(real, (N_LAYERS, N_EXPERTS, TOP_K), seed=seed)
    ids, w = generate(fit.routing, 60, 543, N_LAYERS, N_EXPERTS, TOP_K, seed)  # ~ trace-sized
    synth = stats_of(ids, w, N_EXPERTS)
    return {"params": _params(fit.routing), "real": real, "synthetic": synth}


MIXTRAL_EXPERTS = 8


def mixtral_counts(trace_dir: str) -> np.ndarray:
    """[domains, layers, 8] Mixtral top-2 expert counts, checked (core.traces.load_counts)."""
    return load_counts(
        trace_dir, "mixtral_counts_topk", MIXTRAL_EXPERTS, trace_dir_flag="trace_dir"
    )


def mixtral_comparison(counts: np.ndarray, seed: int) -> dict[str, Any]:
    fit = fit_to_counts(counts, top_k=2, seed=seed)
    return {"params": _params(fit.routing), "real": fit.target, "synthetic": fit.achieved}


def _params(cfg: Any) -> dict[str, float]:
    return {k: getattr(cfg, k) for k in ("skew", "layer_corr", "reuse", "hot_experts", "hot_share")}


def _table(title: str, real: dict[str, float], synth: dict[str, float]) -> str:
    lines = [title, f"  {'statistic':<24}{'real':>10}{'synthetic':>12}"]
    for key in real:
        if key in synth:
            lines.append(f"  {key:<24}{real[key]:>10.3f}{synth[key]:>12.3f}")
    return "\n".join(lines)


@dataclass
class Options:
    trace_dir: str = "../shared/traces"  # folder holding esft-dsv2lite/ and olmoe-aggregates/
    out: str = "routing_stats.json"
    seed: int = 0


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C: one line and exit 130; routing_stats.json is written only once computed."""
    return int(until_interrupted(lambda: _app(argv)))


def _main(args: Options) -> int:
    try:  # every input checked before the statistics, whose results a bad one would lose
        seed = as_int("seed", args.seed, at_least=0, at_most=2**63 - 1, why="a 64-bit seed")
        out = output_file(args.out, "out", ".json", starts=b'{\n "esft"')
        with output_locked(out, "out", "routing_stats"):  # two at once: the last won, unsaid
            return _stats(args, seed, out)
    except MoepipeError as e:
        say_line(e)
        return 2


def _stats(args: Options, seed: int, out: Path) -> int:
    try:
        counts = mixtral_counts(args.trace_dir)
        plan_accepted()  # inputs accepted: its warnings said now, not as it ends
        esft = esft_comparison(args.trace_dir, seed)
        mix = mixtral_comparison(counts, seed)
    except MoepipeError as e:
        say_line(e)
        return 2
    real, synth = headline(esft["real"]), headline(esft["synthetic"])
    print(_table(f"ESFT-vanilla-lite (26 x 64, top-6) vs synthetic {esft['params']}", real, synth))
    print()
    print(
        _table(
            f"Mixtral aggregate counts (top-2 of 8) vs synthetic {mix['params']}",
            mix["real"],
            mix["synthetic"],
        )
    )
    try:
        with written_whole(out) as tmp:  # whole or not at all (a full disk cut it short)
            tmp.write_text(json.dumps({"esft": esft, "mixtral": mix}, indent=1))
    except OSError as e:
        say_line(cannot_write(f"out={out}", e))
        return 2
    print(f"\nwrote {out}")
    return 0


_app = command("routing_stats", Options, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
