"""Peer benchmark: Hugging Face transformers + accelerate disk offload vs moepipe, same checkpoint,
same prompts, same memory. Prints one row per system (tok/s, memory used, ratio to the best peer);
it writes no files. Rows, memory limits, `room` and the `cold` modes:
docs/commands.md#bench_accelerate;
results: docs/results/peers.md.

Usage:
    python -m experiments.bench.accelerate checkpoint=DIR [hardware=this-machine] [planner=klotski]
        [gpu_frac=0.6] [cpu_frac=0.15] [batch_size=4] [n_batches=15] [prompt_len=16] [gen_len=4]
        [cold=once|pass|false] [cgroup=true] [slack_mb=256] [room=cgroup|tiers]
        [room_margin_mb=64] [klotski_n=-1] [klotski_attn=0]
        [routing=synthetic|trace|auto] [trace_dir=../shared/traces] [peer_limit=0] [repeats=3]
        [executor.dtype=auto|float32|bfloat16]
Each row is the median of `repeats` runs of its system, their spread beside it.
The bench runs itself once per system with `role=...` (and `acc_batch=` for accelerate,
`host_room_mb=` for moepipe): each child prints its result as one JSON line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from core.args import (
    MAX_REPEATS,
    MAX_TOKENS,
    REPEATS_WHY,
    TOKENS_WHY,
    as_float,
    as_int,
    as_share,
)
from core.errors import MoepipeError, did_you_mean
from experiments.common.app import command, kv
from experiments.common.bench_memory import checked_room
from experiments.common.cli import exit_command
from experiments.common.held_warnings import warnings_held
from experiments.common.option_names import BENCH_OPTIONS, named_as
from experiments.common.peers import (
    COLD,
    RESULT,
    ROLES,
    checked_routing,
    child,
    compare,
    format_rows,
    measure_room,
    peak_rss,
    run_spec,
)
from experiments.common.schema import BenchAccelerateOptions
from planners.registry import make_planner


def checked(opts: BenchAccelerateOptions) -> dict[str, object]:
    """The options as the peers library reads them (a flat dict), their ranges checked."""
    from real.checkpoint import run_dtype  # torch's import, in the bench's process alone

    d = kv(opts)
    d["executor.dtype"] = run_dtype(d["executor.dtype"])
    d["cold"] = str(d["cold"]).lower()
    if d["cold"] not in COLD:
        raise MoepipeError(
            f"cold={opts.cold!r} unknown; {did_you_mean(opts.cold, COLD)}valid: {', '.join(COLD)}"
        )
    for k in ("gpu_frac", "cpu_frac"):
        as_share(k, d[k], 1.0, "a share of the model's bytes")
    if float(d["gpu_frac"]) + float(d["cpu_frac"]) >= 1:
        raise MoepipeError(
            f"gpu_frac={d['gpu_frac']} + cpu_frac={d['cpu_frac']} >= 1: the budget holds the whole "
            "model, so nothing is offloaded; this bench compares offloading: choose fractions "
            "that sum below 1"
        )
    if d["role"] is not None and d["role"] not in ROLES:
        raise MoepipeError(
            f"role={d['role']!r}: set by the bench for its own child processes "
            f"({', '.join(ROLES)}); leave it out"
        )
    _check_childs_options(d)
    for k in ("batch_size", "n_batches", "prompt_len", "gen_len"):
        as_int(k, d[k], at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
    as_int("slack_mb", d["slack_mb"], at_least=0)
    as_int("repeats", d["repeats"], at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY)
    as_float("peer_limit", d["peer_limit"], at_least=0.0)
    d["room"] = checked_room(str(d["room"]), d["cold"])
    as_int("room_margin_mb", d["room_margin_mb"], at_least=0)
    as_int("host_room_mb", d["host_room_mb"], at_least=0)
    as_int("klotski_n", d["klotski_n"], at_least=-1)
    as_int("klotski_attn", d["klotski_attn"], at_least=0)
    d["routing"] = checked_routing(str(d["routing"]))
    make_planner(str(d["planner"]), {})  # an unknown planner, before the children start
    return d


def _check_childs_options(d: dict[str, Any]) -> None:
    """The options the bench sets for its children alone: refused from a user (the bench set
    its own in their place, so `acc_batch=8` ran as if unsaid), checked in a child."""
    defaults = kv(BenchAccelerateOptions(checkpoint=""))
    if d["role"] is None:
        for k in ("host_room_mb", "acc_batch", "acc_limit_s"):
            if d[k] != defaults[k]:
                raise MoepipeError(
                    f"{k}={d[k]}: set by the bench for its own child processes; leave it out"
                )
    if d["role"] == "accelerate":
        as_int("acc_batch", d["acc_batch"], at_least=1)
        as_float("acc_limit_s", d["acc_limit_s"], at_least=0.0)


def _main(opts: BenchAccelerateOptions) -> int:
    # warnings about the bench held until its plan is accepted, as a run's (warnings_held)
    with named_as(BENCH_OPTIONS), warnings_held() as said:
        return _bench(opts, said)


def _bench(opts: BenchAccelerateOptions, said: Callable[[], None]) -> int:
    d = checked(opts)
    if opts.role:  # a child: one system, its result as the last stdout line
        said()
        result = child(opts.role, d)
        print(RESULT + json.dumps({**result, "peak_rss_bytes": peak_rss()}), flush=True)
        return 0
    from experiments.common.real_run import unchanged_throughout

    with unchanged_throughout(str(d["checkpoint"])):  # every system's child on one checkpoint
        _, budget_hw = run_spec({**d, "host_room_mb": 0})  # the user's mistakes, before a child
        room = measure_room(d, budget_hw, opts.cgroup)
        d = room.options(d)
        spec, hw = run_spec(d)  # moepipe's side: its child plans these tiers too
        said()
        rows, header = compare(d, spec, hw, room)
    print("\n".join([*header, *format_rows(rows)]))
    return 0


main = command("bench_accelerate", BenchAccelerateOptions, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
