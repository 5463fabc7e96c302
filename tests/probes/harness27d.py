"""Round 27d's probe harness (issue 48): the real half and sweeps as a failing machine would
run them, over `tests.probes.cases27d.CASES` (commands run once, sorted by
`tests.probes.harness26d.classify`) and `SCENARIOS` (a distributed run with a rank killed at a
random moment, a `-m` sweep stopped at a random moment then run again and compared with one
that was not stopped), each sorted into one of `harness26d.KINDS`.

Usage: python -m tests.probes.harness27d [CLASS_OR_ID ...]   (one row a case, then counts)
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.conftest import user_env
from tests.probes.harness26d import KINDS, ROOT, Case, run_case

DIST = (
    "executor=real", "executor.distributed=true", "checkpoint={ck}", "planner=eplb",
    "hardware=h200-hgx8", "workload=tiny", "+planner.params.n_devices=2",
)  # fmt: skip
SWEEP = ("model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen,eplb,klotski",
         "workload.gen_len=2,3")  # fmt: skip
VARYING = ("wall_s",)  # summary.json keys a run of one config may not repeat


@dataclass(frozen=True)
class Scenario:
    """A probe that runs its own processes in `t` (`run(t, base, rng)` -> (kind, line))."""

    id: str
    cls: str
    run: Callable[[Path, dict[str, Path], random.Random], tuple[str, str]]


def _popen(args: list[str], **kw: object) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "experiments.run", *args], cwd=ROOT, env=user_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def descendants(pid: int) -> list[int]:
    """`pid`'s processes below it, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(stat[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _ranks(pid: int) -> list[int]:
    """The ranks of the distributed run `pid` started: its forkserver's children."""
    below = descendants(pid)
    servers = [p for p in below if _parent(p) == pid and b"forkserver" in _cmdline(p)]
    return [p for p in below if _parent(p) in servers]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def _outcome(p: subprocess.Popen, timeout: float = 240) -> tuple[int, list[str]]:
    try:
        _, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        return -1, ["hung"]
    said = [s for s in err.replace("\r", "\n").splitlines() if s.strip()]
    return p.returncode, said


def kill_rank(sig: signal.Signals) -> Callable[[Path, dict[str, Path], random.Random], tuple]:
    """A distributed run over a finished one's dir: a rank gets `sig` at a random moment of
    its run. Good: the run ends in one line (or finishes, where the rank ignores the
    signal), the earlier result whole, no process left."""

    def run(t: Path, base: dict[str, Path], rng: random.Random) -> tuple[str, str]:
        shutil.copytree(base["dist"], t / "out")
        before = (t / "out" / "summary.json").read_bytes()
        p = _popen([a.replace("{ck}", str(base["ck"])) for a in DIST] + [f"hydra.run.dir={t}/out"])
        end = time.monotonic() + 90
        while p.poll() is None and time.monotonic() < end and not _ranks(p.pid):
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 1.5))
        ranks = _ranks(p.pid)
        for pid in ranks[:1]:
            os.kill(pid, sig)
        rc, said = _outcome(p)
        after = t / "out" / "summary.json"
        errs = [s for s in said if not s.startswith("[")]
        last = errs[-1] if errs else ""
        if any("Traceback" in s for s in said):
            return "traceback", last
        if rc == -1:
            return "other", "hung"
        if not after.exists() or (rc != 0 and after.read_bytes() != before):
            return "lost", last
        if rc != 0 and (len(errs) != 1 or not errs[0].startswith("error: ")):
            return "multiline", " | ".join(errs)[-300:]
        left = [q for q in ranks if Path(f"/proc/{q}").exists() and _parent(q) != 1]
        return ("good" if rc != 0 else "designed") if not left else "other", last

    return run


def _results(d: Path) -> dict[str, dict]:
    out = {}
    for s in d.rglob("summary.json"):
        rel = s.parent.relative_to(d)
        if any(part.startswith(".") for part in rel.parts):
            continue
        got = json.loads(s.read_text())
        for key in VARYING:
            got.pop(key, None)
        out[str(rel)] = got
    return out


def stop_sweep(
    sig: signal.Signals, launcher: str, group: bool = True
) -> Callable[..., tuple[str, str]]:
    """A `-m` sweep stopped by `sig` at a random moment, then the same command again: its
    points and each summary.json equal an unstopped sweep's, its table (collect) too. SIGKILL
    goes to the terminal's whole job, or (`group` false) to the sweep's own process alone."""

    def run(t: Path, base: dict[str, Path], rng: random.Random) -> tuple[str, str]:
        args = [
            *SWEEP,
            f"hydra.sweep.dir={t}/s",
            *([f"hydra/launcher={launcher}"] * bool(launcher)),
        ]
        p = _popen(["-m", *args])
        time.sleep(rng.uniform(1.0, 8.0))
        with_group = sig == signal.SIGKILL and group  # kill -9 of the terminal's job
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig) if with_group else p.send_signal(sig)
        rc, said = _outcome(p)
        again = _popen(["-m", *args])
        rc2, said2 = _outcome(again)
        last = (said2 or [""])[-1]
        if any("Traceback" in s for s in said + said2):
            return "traceback", last
        if rc2 != 0:
            return "other", f"resumed: exit {rc2}: {last}"
        got, want = _results(t / "s"), _results(base["sweep"])
        if set(got) != set(want):
            return "lost", f"points {sorted(set(got) ^ set(want))}"
        differ = [k for k in got if got[k] != want[k]]
        if differ:
            return "other", f"{differ[0]} differs"
        if _table(t / "s", t / "c") != _table(base["sweep"], t / "c0"):
            return "other", "collect's table differs"
        return "good", last

    return run


def _table(sweep: Path, out: Path) -> str:
    """collect's results.csv of `sweep`, its rows in run dir order."""
    subprocess.run(
        [sys.executable, "-m", "experiments.collect", f"dir={sweep}", f"out={out}"],
        cwd=ROOT, env=user_env(), capture_output=True,
    )  # fmt: skip
    head, *rows = (out / "results.csv").read_text().splitlines()
    return "\n".join([head, *sorted(rows)])


def _base(home: Path) -> dict[str, Path]:
    """harness26d's tiny checkpoint and run, a finished distributed run of that checkpoint and
    a sweep that ran unstopped."""
    from tests.probes.harness26d import _base as base26

    out = base26(home)
    dist, sweep = home / "base_dist", home / "base_sweep"
    if not dist.exists():
        args = [a.replace("{ck}", str(out["ck"])) for a in DIST]
        _outcome(_popen([*args, f"hydra.run.dir={dist}"]))
    if not sweep.exists():
        _outcome(_popen(["-m", *SWEEP, f"hydra.sweep.dir={sweep}"]))
    return {**out, "dist": dist, "sweep": sweep}


def main(selected: list[str]) -> Counter:
    from tests.probes.cases27d import CASES, SCENARIOS

    home = Path(tempfile.gettempdir()) / "probe27d"
    home.mkdir(exist_ok=True)
    base = _base(home)
    chosen = [c for c in [*CASES, *SCENARIOS] if not selected or {c.cls, c.id} & set(selected)]
    counts: Counter = Counter()
    for i, case in enumerate(chosen):
        if not isinstance(case, Case):  # a Scenario (this module's, imported by cases27d)
            t = home / case.id
            shutil.rmtree(t, ignore_errors=True)
            t.mkdir(parents=True)
            kind, line = case.run(t, base, random.Random(i))
        else:
            kind, line = run_case(case, home)
        counts[kind] += 1
        print(f"{kind:10} {case.cls:12} {case.id:32} {line[:200]}", flush=True)
    print(f"{len(chosen)} cases: " + ", ".join(f"{k} {counts[k]}" for k in KINDS))
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
