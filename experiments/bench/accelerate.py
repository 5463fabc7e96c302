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
The bench runs itself once per system, told its role (and `acc_batch` for accelerate,
`host_room_mb` for moepipe) in $MOEPIPE_BENCH_CHILD, not on its command line, where a user's
would be refused: each child prints its result as one JSON line.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from core.args import (
    MAX_REPEATS,
    MAX_TOKENS,
    PEER_LIMIT,
    PEER_LIMIT_WHY,
    REPEATS_WHY,
    TOKENS_WHY,
    as_float,
    as_int,
    as_share,
    as_size_mb,
)
from core.errors import MoepipeError, did_you_mean
from experiments.common.app import command, kv
from experiments.common.bench_memory import checked_room
from experiments.common.cli import exit_command
from experiments.common.conf_files import override_value
from experiments.common.held_warnings import plan_accepted
from experiments.common.option_names import BENCH_OPTIONS, named_as
from experiments.common.peers import (
    CHILD_ENV,
    CHILD_KEYS,
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
    if d["role"] is not None and d["role"] not in ROLES:  # (a child's: from_the_bench)
        raise MoepipeError(f"role={d['role']!r}: unknown; valid: {', '.join(ROLES)}")
    _check_childs_options(d)
    for k in ("batch_size", "n_batches", "prompt_len", "gen_len"):
        as_int(k, d[k], at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
    as_size_mb("slack_mb", d["slack_mb"])
    as_int("repeats", d["repeats"], at_least=1, at_most=MAX_REPEATS, why=REPEATS_WHY)
    as_float("peer_limit", d["peer_limit"], at_least=0.0, at_most=PEER_LIMIT, why=PEER_LIMIT_WHY)
    d["room"] = checked_room(str(d["room"]), d["cold"])
    as_size_mb("room_margin_mb", d["room_margin_mb"])
    as_size_mb("host_room_mb", d["host_room_mb"])
    as_int("klotski_n", d["klotski_n"], at_least=-1)
    as_int("klotski_attn", d["klotski_attn"], at_least=0)
    d["routing"] = checked_routing(str(d["routing"]))
    make_planner(str(d["planner"]), {})  # an unknown planner, before the children start
    return d


def from_the_bench(opts: BenchAccelerateOptions) -> BenchAccelerateOptions:
    """`opts` with what the bench tells a child of its own (CHILD_ENV; taken, so a process the
    child starts is no child of the bench). The same options from a user's command line are
    refused: the bench set its own in their place (`acc_batch=8` ran as if unsaid), and
    `role=moepipe host_room_mb=500` measured one system at tiers no bench gives it."""
    defaults = BenchAccelerateOptions(checkpoint="")
    for k in CHILD_KEYS:
        if getattr(opts, k) != getattr(defaults, k):
            raise MoepipeError(
                f"{k}={override_value(getattr(opts, k))}: set by the bench for its own child "
                "processes, not on a command line; leave it out"
            )
    given = os.environ.pop(CHILD_ENV, None)
    return replace(opts, **json.loads(given)) if given else opts


def _check_childs_options(d: dict[str, Any]) -> None:
    """The options the bench sets for its children alone (`from_the_bench`), checked in one."""
    if d["role"] == "accelerate":
        as_int("acc_batch", d["acc_batch"], at_least=1, at_most=MAX_TOKENS, why=TOKENS_WHY)
        as_float("acc_limit_s", d["acc_limit_s"], at_least=0.0)


def _main(opts: BenchAccelerateOptions) -> int:
    # warnings about the bench held until its plan is accepted, as a run's (held_warnings)
    with named_as(BENCH_OPTIONS):
        return _bench(from_the_bench(opts))


def _bench(opts: BenchAccelerateOptions) -> int:
    d = checked(opts)
    if opts.role:  # a child: one system, its result as the last stdout line
        plan_accepted()
        result = child(opts.role, d)
        print(RESULT + json.dumps({**result, "peak_rss_bytes": peak_rss()}), flush=True)
        return 0
    from experiments.common.real_run import unchanged_throughout

    with unchanged_throughout(str(d["checkpoint"])):  # every system's child on one checkpoint
        _, budget_hw = run_spec({**d, "host_room_mb": 0})  # the user's mistakes, before a child
        room = measure_room(d, budget_hw, opts.cgroup)
        d = room.options(d)
        spec, hw = run_spec(d)  # moepipe's side: its child plans these tiers too
        plan_accepted()
        rows, header = compare(d, spec, hw, room)
    print("\n".join([*header, *format_rows(rows)]))
    return 0


main = command("bench_accelerate", BenchAccelerateOptions, _main, __doc__)

if __name__ == "__main__":
    exit_command(main)
