"""moepipe against Hugging Face accelerate's disk offload, each system in a child process of
its own inside a memory cgroup (where one can be made): the library of experiments.bench.accelerate
and experiments.bench.real. The module doc of experiments/bench/accelerate.py says what each row
is and what `cold` does.

Usage:
    room = measure_room(opts, hw, use_cgroup)   # opts: bench_accelerate's, as a dict
    opts = room.options(opts)
    spec, hw = run_spec(opts)   # the moepipe side's, its host room included
    rows, header = compare(opts, spec, hw, room)
    print("\n".join([*header, *format_rows(rows)]))
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from core.errors import MoepipeError, did_you_mean
from experiments.common.bench_memory import (
    UNLIMITED,
    MemoryCgroup,
    Room,
    check_trace_routing,
    drop_page_cache,
    host_room_bytes,
)
from experiments.common.conf_files import override_value
from experiments.common.option_names import (
    BENCH_OPTIONS,
    own_names,
    own_names_now,
    said_before,
)
from experiments.common.pool import leave_stops_to_parent as ignore_ctrl_c  # a child's start

COLD = ("pass", "once", "false")
ROLE = "role"  # the option that makes the bench command run one system (in its own process)
ROLES = ("probe", "moepipe", "accelerate")  # its values
# what the bench alone tells a child: in this variable as JSON, not on its command line, where
# a user's would change what the bench measures without a word (the command refuses them)
CHILD_ENV, CHILD_KEYS = "MOEPIPE_BENCH_CHILD", (ROLE, "host_room_mb", "acc_batch", "acc_limit_s")
RESULT = "BENCH-RESULT "  # a child's last stdout line: this prefix and a JSON object


# ---- the systems, each run in a child process --------------------------------------------


def placed_mb(model: Any) -> str:
    """MB of parameters per device of accelerate's device map, e.g. "cpu 159 MB, disk 159 MB"."""
    # no map where nothing was offloaded (accelerate left the model whole on one device)
    where: dict[str, str] = {k: str(v) for k, v in getattr(model, "hf_device_map", {}).items()}
    mb: dict[str, float] = {}
    for name, p in model.named_parameters():
        parts = name.split(".")
        prefixes = (".".join(parts[:i]) for i in range(len(parts), -1, -1))
        dev = next((where[q] for q in prefixes if q in where), "?")
        mb[dev] = mb.get(dev, 0.0) + p.numel() * p.element_size() / 1e6
    return ", ".join(f"{d} {v:.0f} MB" for d, v in sorted(mb.items()))


def run_accelerate(
    ckpt: str,
    device_bytes: int,
    host_bytes: int,
    prompts: Any,
    batch_size: int,
    gen_len: int,
    cold: str,
    limit_s: float = 0.0,
    dtype: str = "auto",
) -> float | None:
    """Seconds for greedy generation of `prompts` [N, P], `batch_size` sequences per `generate`
    call, with accelerate's disk offload holding `device_bytes` on the device and `host_bytes`
    in host RAM (their sum in RAM without CUDA); `cold` as in the module doc (with "pass", the
    page-cache drops are not counted). None where `limit_s` > 0 and the generation (loading not
    counted) ran that long: it is stopped there. In `dtype` (executor.dtype, from_pretrained's)."""
    import torch
    from transformers import AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    max_memory: dict[int | str, int] = (
        {0: device_bytes, "cpu": host_bytes} if cuda else {"cpu": device_bytes + host_bytes}
    )
    with tempfile.TemporaryDirectory(prefix="offload-") as folder:
        torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(
            ckpt, device_map="auto", max_memory=max_memory, offload_folder=folder, dtype=torch_dtype
        )
        model.eval()
        print(f"accelerate placement: {placed_mb(model)}", file=sys.stderr)
        dropping = [0.0]  # seconds spent dropping the page cache inside the timed region

        def drop_before_pass(*_: Any) -> None:
            t = time.perf_counter()
            drop_page_cache(ckpt, folder, everything=False)  # the weights' files alone
            dropping[0] += time.perf_counter() - t

        if cold != "false":
            drop_page_cache(ckpt, folder, everything=False)
        if cold == "pass":
            model.register_forward_pre_hook(drop_before_pass)
        first = "cuda:0" if cuda else "cpu"
        t0 = time.perf_counter()
        try:
            with _time_limit(limit_s), torch.inference_mode():
                for b in range(0, prompts.shape[0], batch_size):
                    ids = prompts[b : b + batch_size].to(first)
                    model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=gen_len,
                        min_new_tokens=gen_len,
                        do_sample=False,
                        pad_token_id=0,
                        # as moepipe's run, whatever the checkpoint's generation_config.json says
                        max_time=None,
                        num_return_sequences=1,
                    )
        except _Stopped:
            print(f"accelerate: stopped at its time limit, {limit_s:.1f} s", file=sys.stderr)
            return None
        total = time.perf_counter() - t0
        print(f"accelerate: {dropping[0]:.2f} s of page-cache drops not counted", file=sys.stderr)
        return total - dropping[0]


class _Stopped(Exception):
    """A peer's generation ran past its time limit."""


@contextlib.contextmanager
def _time_limit(seconds: float) -> Any:
    """Raise _Stopped in the block once `seconds` of wall time have passed (0: never). A SIGALRM
    handler, so it lands between two of the peer's Python-level calls, within one kernel."""
    if seconds <= 0:
        yield
        return

    def stop(*_: Any) -> None:
        raise _Stopped

    before = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, before)


def checked_routing(routing: str) -> str:
    """`routing` lower-cased, or a MoepipeError naming the valid sources (live is not one: both
    sides would then route by their own random gates)."""
    valid = ("auto", "trace", "synthetic")
    if routing.lower() not in valid:
        raise MoepipeError(
            f"routing={routing!r} unknown; {did_you_mean(routing, valid)}valid: {', '.join(valid)}"
        )
    return routing.lower()


def run_spec(opts: dict[str, Any]) -> tuple[Any, Any]:
    """(RunSpec, HardwareSpec) of the moepipe side, from the bench's options."""
    from core.spec import RoutingConfig, Workload
    from core.types import RoutingSource
    from experiments.common.hardware import load_hardware, read_hardware
    from experiments.common.pipeline import RunSpec
    from real.checkpoint import load_checkpoint

    read_hardware(str(opts["hardware"]))  # its problems before the checkpoint's
    model, _ = load_checkpoint(opts["checkpoint"], str(opts["executor.dtype"]))
    check_trace_routing(str(opts.get("routing", "synthetic")), model)
    hw = load_hardware(str(opts["hardware"]), model.total_bytes, opts["gpu_frac"], opts["cpu_frac"])
    hw = with_host_room(hw, int(opts.get("host_room_mb", 0)) << 20)
    sizes = {k: opts[k] for k in ("batch_size", "n_batches", "prompt_len", "gen_len")}
    routing = RoutingConfig(
        source=RoutingSource(str(opts.get("routing", "synthetic")).lower()),
        trace_dir=str(opts.get("trace_dir", "../shared/traces")),
    )
    wl = Workload(**sizes, routing=routing)
    # a bench's Klotski reserves memory for the real executor's activations: the simulator's
    # prediction of the run plans the same schedule
    params = (
        {
            "n": int(opts.get("klotski_n", -1)),
            "attn_batches": int(opts.get("klotski_attn", 0)),
            "real_activations": True,
        }
        if opts["planner"] == "klotski"
        else {}
    )
    return RunSpec(model, hw, wl, str(opts["planner"]), params), hw


def with_host_room(hw: Any, room_bytes: int) -> Any:
    """`hw` with `room_bytes` more host tier (moepipe's side under room=cgroup; see Room)."""
    from core.types import Tier

    if room_bytes <= 0:
        return hw
    mem = dict(hw.memory_bytes)
    mem[Tier.CPU] = int(mem[Tier.CPU]) + room_bytes
    return replace(hw, memory_bytes=mem)


def child(role: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Run one system in this (child) process; its result as a JSON-able dict."""
    import torch

    from core.types import Tier
    from experiments.common.real_run import prompts_for, real_execute

    if role == "probe":  # the runtime every side pays before any weight: imports, allocator
        import transformers  # noqa: F401

        torch.ones(1) @ torch.ones(1)
        return {}
    # accelerate's max_memory is the budget: the page cache takes the cgroup's room for it
    spec, hw = run_spec(opts if role == "moepipe" else {**opts, "host_room_mb": 0})
    if role == "moepipe":
        result, _ = real_execute(opts["checkpoint"], spec, "replay", dtype=opts["executor.dtype"])
        s = result.summary
        return {
            "tok_s": s["throughput_tok_s"],
            "seconds": s["makespan_s"],
            "n_batches": s["n_batches"],
            "dag_efficiency": s.get("dag_efficiency"),
            "tokens": spec.workload.with_(n_batches=s["n_batches"]).tokens_generated,
            "n_plan": result.schedule.meta.get("n_plan", {}),  # how its planner set n
        }
    wl = spec.workload.with_(n_batches=int(opts["n_batches"]))
    prompts = prompts_for(spec.model, wl)
    budget, host = int(hw.memory_bytes[Tier.GPU]), int(hw.memory_bytes[Tier.CPU])
    seconds = run_accelerate(
        opts["checkpoint"],
        budget,
        host,
        prompts,
        int(opts["acc_batch"]),
        wl.gen_len,
        str(opts["cold"]),
        float(opts.get("acc_limit_s", 0.0)),
        str(opts["executor.dtype"]),
    )
    if seconds is None:  # stopped: it would have taken longer than its limit
        return {
            "tok_s": None,
            "seconds": None,
            "stopped_s": float(opts["acc_limit_s"]),
            "tokens": wl.tokens_generated,
        }
    return {
        "tok_s": wl.tokens_generated / seconds,
        "seconds": seconds,
        "tokens": wl.tokens_generated,
    }


@dataclass
class Row:
    system: str
    batch: int  # sequences per generate call (moepipe: per batch, times n)
    tok_s: float | None  # None: did not fit
    seconds: float | None
    peak_rss_bytes: int | None
    peak_cgroup_bytes: int | None  # RSS + page cache charged to its cgroup
    note: str = ""
    dag_efficiency: float | None = None  # moepipe: schedule's own critical path / makespan
    stopped_s: float | None = None  # a peer stopped at this time limit, `tokens` not all made
    tokens: int = 0
    runs: tuple[float, ...] = ()  # every repeat's tok/s, fastest first (tok_s: their median)

    @property
    def tok_s_at_most(self) -> float | None:
        """Its tok/s, or for a stopped peer the most it could have reached (it would have made
        `tokens` in more than `stopped_s`)."""
        if self.tok_s is not None:
            return self.tok_s
        return self.tokens / self.stopped_s if self.stopped_s else None


def run_side(
    role: str, opts: dict[str, Any], limit_bytes: int | None, **extra: Any
) -> tuple[dict[str, Any] | None, int | None, str]:
    """Run `role` in a child process (inside a memory cgroup of `limit_bytes` where one can be
    made): (its result or None if it failed, the cgroup's peak bytes, why it failed)."""
    args = {**opts, **extra, ROLE: role}
    mine = {k: args.pop(k) for k in CHILD_KEYS if k in args}
    cmd = [
        sys.executable,
        "-m",
        "experiments.bench.accelerate",
        *(f"{k}={override_value(v)}" for k, v in args.items()),
    ]
    cg = MemoryCgroup.create(f"bench-{role}", limit_bytes) if limit_bytes else None
    drop_page_cache(opts["checkpoint"], everything=False)  # charged to whoever reads it next
    errors: list[str] = []  # the child's own error line, said once, by the bench
    try:
        proc = subprocess.Popen(
            cg.wrap(cmd) if cg else cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=ignore_ctrl_c,  # Ctrl-C is the bench's: it kills the child, one line
            env={**os.environ, CHILD_ENV: json.dumps(mine)},
        )
        relaying = threading.Thread(target=relay, args=(proc.stderr, errors), daemon=True)
        relaying.start()
        try:
            out = proc.stdout.read() if proc.stdout else ""
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        relaying.join()
        peak = cg.peak_bytes() if cg else None
        oom = cg.oom_killed() if cg else False
    finally:
        if cg:
            cg.remove()
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT) :]), peak, ""
    if oom:
        return None, peak, "out of memory (cgroup limit)"
    return None, peak, errors[-1] if errors else f"exit status {proc.returncode}"


def relay(stream: Any, errors: list[str]) -> None:
    """A child's stderr onto the bench's as it comes, except its `error: ` line, kept in
    `errors`: the bench's own line says it, instead of a second error line after it. Its
    warnings name the bench's options (`own_names_now`), as the bench's own do, and a line the
    bench or an earlier child said already is not said again (`said_before`)."""
    for line in stream:
        if line.startswith("error: "):
            errors.append(line.removeprefix("error: ").strip())
        elif not said_before(own_names_now(line)):
            sys.stderr.write(own_names_now(line))
            sys.stderr.flush()


def side_failed(system: str, why: str, names: dict[str, str] | None = None) -> MoepipeError:
    """The bench's one line for a child that failed: its own error where it printed one, with
    the run's keys it names as the bench's options (`names`, default BENCH_OPTIONS)."""
    why = own_names(why, names or BENCH_OPTIONS)
    tail = "; see its output above" if why.startswith("exit status") else ""
    return MoepipeError(f"{system} failed: {why}{tail}")


def run_repeated(
    role: str,
    opts: dict[str, Any],
    limit_bytes: int | None,
    first: dict[str, Any] | None = None,
    **extra: Any,
) -> tuple[dict[str, Any] | None, int | None, str, list[float]]:
    """`run_side` `opts["repeats"]` times (default once), each from a page cache dropped as
    before the first; `first`: a run already made, counted as one. (The run of median time,
    the slower of two middle ones, or the first run that failed or was stopped; the largest
    peak; every run's tok/s, fastest first.)"""
    n = max(1, int(opts.get("repeats", 1)))
    runs = [first] if first is not None else []
    peaks: list[int] = []
    while len(runs) < n:
        if n > 1:
            print(f"[bench]   run {len(runs) + 1} of {n}", file=sys.stderr, flush=True)
        got, peak, why = run_side(role, opts, limit_bytes, **extra)
        peaks += [peak] if peak is not None else []
        if got is None or got.get("tok_s") is None:
            return got, max(peaks, default=None), why, []
        runs.append(got)
    runs.sort(key=lambda g: float(g["seconds"]))
    return runs[len(runs) // 2], max(peaks, default=None), "", [float(g["tok_s"]) for g in runs]


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def compare(
    opts: dict[str, Any], spec: Any, hw: Any, room: Room, batch_by_batch: bool = True
) -> tuple[list[Row], list[str]]:
    """Every row (moepipe, its run at the budget tiers where `room` gave it more, then
    accelerate all-in-one, then batch by batch unless not `batch_by_batch`) and header lines.
    `opts`, `spec` and `hw`: `room.options`'s, the moepipe side's. Progress on stderr."""
    limit = room.limit_bytes
    rows, n = moepipe_rows(opts, spec, room)
    limit_s = float(opts.get("peer_limit", 0.0)) * float(rows[0].seconds or 0.0)
    opts = dict(opts, n_batches=n, acc_limit_s=limit_s)
    every = n * spec.workload.batch_size
    batch = every
    while True:  # the largest batch that fits: every prompt at once, halved while it does not
        print(f"[bench] accelerate, batch {batch} ...", file=sys.stderr, flush=True)
        got, peak, why, runs = run_repeated("accelerate", opts, limit, acc_batch=batch)
        calls = -(-every // batch)
        name = f"accelerate, {calls} generate call{'s' if calls > 1 else ''}"
        if got is not None or batch <= spec.workload.batch_size:
            rows.append(_row(name, batch, got, peak, why, runs))
            break
        rows.append(_row(name, batch, None, peak, why))
        batch = max(spec.workload.batch_size, batch // 2)
    if batch_by_batch and batch != spec.workload.batch_size:
        print("[bench] accelerate, batch by batch ...", file=sys.stderr, flush=True)
        got, peak, why, runs = run_repeated(
            "accelerate", opts, limit, acc_batch=spec.workload.batch_size
        )
        name = f"accelerate, batch by batch ({n} calls)"
        rows.append(_row(name, spec.workload.batch_size, got, peak, why, runs))
    mb = spec.model.total_bytes / 1e6
    tokens = spec.workload.with_(n_batches=n).tokens_generated
    header = [
        f"model {spec.model.name} {mb:.0f} MB, budget {room.budget_bytes / 1e6:.0f} MB (device "
        f"{room.device_bytes / 1e6:.0f} + host {room.host_bytes / 1e6:.0f}), "
        f"rest on disk, cold={opts['cold']}, {n} x {spec.workload.batch_size} prompts, "
        f"{tokens} tokens",
        *room.lines(hw),
    ]
    if limit_s:
        header.append(
            f"accelerate stopped after {opts['peer_limit']:g} x moepipe's makespan "
            f"({limit_s:.1f} s of generation; loading not counted)"
        )
    return rows, header


# ---- the room, measured: one cgroup limit for every side (bench_memory.Room)


def measure_room(opts: dict[str, Any], hw: Any, use_cgroup: bool) -> Room:
    """The comparison's Room (see there): the runtime allowance measured by a bare child (role=
    probe) in a cgroup without a real limit, and with room=cgroup moepipe's run at the budget
    tiers in the limit, whose peak sets the host room. `hw`: the budget's hardware (run_spec's
    without host_room_mb). Progress on stderr."""
    from core.types import Tier

    room = Room(
        str(opts.get("room", "cgroup")),
        int(hw.memory_bytes[Tier.GPU]),
        int(hw.memory_bytes[Tier.CPU]),
        slack_bytes=int(opts["slack_mb"]) << 20,
        margin_bytes=int(opts.get("room_margin_mb", 0)) << 20,
    )
    if not use_cgroup:
        return room
    probe = MemoryCgroup.create("bench-probe", UNLIMITED)
    if probe is None:
        return room
    probe.remove()
    _, runtime, _ = run_side("probe", opts, UNLIMITED)
    room = replace(room, runtime_bytes=runtime or 0)
    room = replace(room, limit_bytes=room.budget_bytes + room.runtime_bytes + room.slack_bytes)
    if room.mode == "tiers":
        return room
    print(f"[bench] moepipe {opts['planner']} at the budget tiers ...", file=sys.stderr, flush=True)
    got, peak, why = run_side("moepipe", dict(opts, host_room_mb=0), room.limit_bytes)
    if got is None:
        raise side_failed(f"moepipe {opts['planner']}", why)
    assert room.limit_bytes is not None
    peak = peak or room.limit_bytes  # unread: no room
    return replace(
        room,
        budget_run={**got, "peak_cgroup_bytes": peak},
        budget_peak_bytes=peak,
        host_room_bytes=host_room_bytes(room.limit_bytes, peak, room.margin_bytes),
    )


def moepipe_rows(opts: dict[str, Any], spec: Any, room: Room) -> tuple[list[Row], int]:
    """moepipe's rows and its n: the run of `opts` (`room.options`'s) in the cgroup, then,
    where the room gave it more host tier, its run at the budget tiers; with no room, that
    run (already measured) is the one row."""

    def row(name: str, got: dict[str, Any], peak: int | None, runs: list[float]) -> Row:
        return Row(
            name,
            spec.workload.batch_size,
            got["tok_s"],
            got["seconds"],
            got["peak_rss_bytes"],
            peak,
            dag_efficiency=got.get("dag_efficiency"),
            runs=tuple(runs),
        )

    first = room.budget_run
    if first is None or room.host_room_bytes or int(opts.get("repeats", 1)) > 1:
        print(f"[bench] moepipe {spec.planner} ...", file=sys.stderr, flush=True)
    if first is not None and not room.host_room_bytes:  # that run is the first of its repeats
        got, peak, why, runs = run_repeated("moepipe", opts, room.limit_bytes, first)
        peak = max(p for p in (peak, room.budget_peak_bytes, 0) if p is not None) or None
    else:
        got, peak, why, runs = run_repeated("moepipe", opts, room.limit_bytes)
    if got is None:
        raise side_failed(f"moepipe {spec.planner}", why)
    n = int(got["n_batches"])
    if first is None or not room.host_room_bytes:
        return [row(f"moepipe {spec.planner} (n={n})", got, peak, runs)], n
    plus = f"host +{room.host_room_bytes / 1e6:.0f} MB"
    return [
        row(f"moepipe {spec.planner} (n={n}), {plus}", got, peak, runs),
        row(f"moepipe {spec.planner} (n={n}), budget tiers", first, room.budget_peak_bytes, []),
    ], n


def _row(
    name: str,
    batch: int,
    got: dict[str, Any] | None,
    peak: int | None,
    why: str,
    runs: list[float] | None = None,
) -> Row:
    if got is None:
        return Row(name, batch, None, None, None, peak, why)
    return Row(
        name,
        batch,
        got["tok_s"],
        got["seconds"],
        got["peak_rss_bytes"],
        peak,
        "stopped at its time limit" if got.get("stopped_s") else "",
        stopped_s=got.get("stopped_s"),
        tokens=int(got.get("tokens", 0)),
        runs=tuple(runs or ()),
    )


def format_rows(rows: list[Row]) -> list[str]:
    """The table, then `moepipe / best peer: X.XXx`: against a stopped peer's most possible
    tok/s where that is the best, `>= X.XXx`."""
    peers = [r for r in rows if not r.system.startswith("moepipe") and r.tok_s_at_most]
    best = max(peers, key=lambda r: r.tok_s_at_most or 0.0) if peers else None

    def mb(b: int | None) -> str:
        return "-" if b is None else f"{b / 1e6:.0f}"

    out = [
        f"{'system':40s} {'batch':>5s} {'tok/s':>8s} {'s':>7s} {'RSS MB':>7s} "
        f"{'RSS+cache MB':>12s} {'x best peer':>11s}"
    ]
    for r in rows:
        head = f"{r.system:40s} {r.batch:5d}"
        if r.stopped_s:
            out.append(
                f"{head} {'<' + format(r.tok_s_at_most, '.2f'):>8s} "
                f"{'>' + format(r.stopped_s, '.0f'):>7s} {mb(r.peak_rss_bytes):>7s} "
                f"{mb(r.peak_cgroup_bytes):>12s}   {r.note}"
            )
            continue
        if r.tok_s is None:
            out.append(
                f"{head} {'-':>8s} {'-':>7s} {mb(r.peak_rss_bytes):>7s} "
                f"{mb(r.peak_cgroup_bytes):>12s}   {r.note}"
            )
            continue
        ratio = "-"
        if best and best.tok_s_at_most:
            more = ">=" if best.stopped_s else ""
            ratio = f"{more}{r.tok_s / best.tok_s_at_most:.2f}x"
        spread = (
            f"   {len(r.runs)} runs {r.runs[-1]:.2f}-{r.runs[0]:.2f}" if len(r.runs) > 1 else ""
        )
        out.append(
            f"{head} {r.tok_s:8.2f} {r.seconds:7.2f} "
            f"{mb(r.peak_rss_bytes):>7s} {mb(r.peak_cgroup_bytes):>12s} {ratio:>11s}{spread}"
        )
    ours = rows[0]
    if best and best.tok_s_at_most and ours.tok_s:
        ratio = ours.tok_s / best.tok_s_at_most
        if best.stopped_s:
            out.append(
                f"moepipe / best peer: >= {ratio:.2f}x ({best.system} stopped at its time limit; "
                f"at most {best.tok_s_at_most:.2f} tok/s)"
            )
        else:
            out.append(f"moepipe / best peer: {ratio:.2f}x ({best.system})")
    return out
