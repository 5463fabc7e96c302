"""Round 26d's probe harness (issue 48): the commands run as a new user and a failing machine
would run them, over the cases of `tests.probes.cases26d`, each sorted into one kind: `good`
(one `error: ` line, a non-zero exit, no result left), `designed` (accepted as documented),
`traceback`, `multiline`, `silent` (a bad input accepted), `lost` (an earlier result gone),
`wrong` (a line that does not name the fault), `other`.

Usage: python -m tests.probes.harness26d [CLASS_OR_ID ...]   (prints one row a case, then counts)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import user_env

ROOT = Path(__file__).resolve().parents[2]
CKPT = ["hidden_size=64", "n_heads=4", "n_kv_heads=2", "expert_ffn_size=32", "vocab_size=128"]
KINDS = ("good", "designed", "traceback", "multiline", "silent", "lost", "wrong", "other")


@dataclass(frozen=True)
class Case:
    """One probe: `args` (`{t}` the case's folder, `{ck}` a copy of a tiny checkpoint there,
    `{run}` a copy of a finished tiny simulated run there) after `setup(t)` made its files."""

    id: str
    cls: str  # issue 48's class: hf_config, safetensors, oserror, hydra, silent, lost
    module: str
    args: tuple[str, ...]
    expect: str = "fail"  # fail: one line, non-zero exit, no result; ok: runs as documented
    names: tuple[str, ...] = ()  # what the failure's line must name
    setup: Callable[[Path], None] | None = None
    after: Callable[[Path], str | None] | None = None  # a problem kind found in the files after
    shell: str = ""  # a shell prefix (`ulimit -f 8;`), the command then run under bash
    timeout: float = 180
    extra: dict[str, str] = field(default_factory=dict)  # environment variables


def _base(home: Path) -> dict[str, Path]:
    """The tiny checkpoint and finished run every case copies, made once under `home`."""
    ck, run = home / "base_ck", home / "base_run"
    if not ck.exists():
        _py("experiments.make_checkpoint", "model=mixtral-tiny", f"out={ck}", "n_layers=2", *CKPT)
    if not run.exists():
        tiny = ["model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen"]
        _py("experiments.run", *tiny, f"hydra.run.dir={run}")
    return {"ck": ck, "run": run}


def _py(module: str, *args: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=user_env(), capture_output=True
    )
    assert r.returncode == 0, r.stderr


def run_case(case: Case, home: Path) -> tuple[str, str]:
    """(kind, the stderr's last line) of `case`, run in a fresh folder under `home`."""
    base, t = _base(home), home / case.id
    _unmounted(t)
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    fields = {"t": str(t), "ck": str(t / "ck"), "run": str(t / "run")}
    shutil.copytree(base["ck"], t / "ck")
    shutil.copytree(base["run"], t / "run")
    if case.setup:
        case.setup(t)
    before = set(t.rglob("summary.json"))
    args = [_filled(a, fields) for a in case.args]
    argv = [sys.executable, "-m", case.module, *args]
    env = {**user_env(), **case.extra}
    try:
        if case.shell:
            line = " ".join(_quoted(a) for a in argv)
            r = subprocess.run(
                ["bash", "-c", f"{case.shell} exec {line}"],
                **_io(env, case.timeout),
            )
        else:
            r = subprocess.run(argv, **_io(env, case.timeout))
    except subprocess.TimeoutExpired:
        return "other", "timed out"
    finally:
        _unmounted(t)
    return classify(case, t, r, before)


def _unmounted(t: Path) -> None:
    """The file systems a case mounted in `t` (a full disk, a read-only one) unmounted."""
    for mount in ("full", "ro", "ck"):
        if (t / mount).is_mount():
            subprocess.run(["umount", "-l", str(t / mount)], check=False)


def _filled(arg: str, fields: dict[str, str]) -> str:
    for key, value in fields.items():
        arg = arg.replace("{" + key + "}", value)
    return arg


def _io(env: dict[str, str], timeout: float) -> dict:
    return {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": timeout}


def _quoted(arg: str) -> str:
    return "'" + arg.replace("'", "'\\''") + "'"


def classify(
    case: Case, t: Path, r: subprocess.CompletedProcess, before: set[Path]
) -> tuple[str, str]:
    """The kind of `r`, the outcome of `case` run in `t` (`before`: its summary.json files
    before it ran)."""
    # a sweep's progress bar and its count of runs finished come before its line
    said = r.stderr.replace("\r", "\n").splitlines()
    err = [line for line in said if line.strip() and not line.startswith("sweep ")]
    last = err[-1] if err else (r.stdout.strip().splitlines() or [""])[-1]
    if "Traceback" in r.stderr + r.stdout:
        return "traceback", last
    if case.after and (kind := case.after(t)):
        return kind, last
    if case.expect == "ok":
        return ("designed" if r.returncode == 0 else "other"), last
    if r.returncode == 0:
        return "silent", last
    if len(err) != 1 or not err[0].startswith("error: "):
        return "multiline", " | ".join(err)[-300:]
    if not all(n in err[0] for n in case.names):
        return "wrong", last
    results = sorted(set(t.rglob("summary.json")) - before)
    if results:
        return "other", f"left {results[0]}: {last}"
    return "good", last


def main(selected: list[str]) -> Counter:
    from tests.probes.cases26d_cmd import CASES

    home = Path(tempfile.gettempdir()) / "probe26d"
    home.mkdir(exist_ok=True)
    cases = [c for c in CASES if not selected or c.cls in selected or c.id in selected]
    counts: Counter = Counter()
    for case in cases:
        kind, line = run_case(case, home)
        counts[kind] += 1
        print(f"{kind:10} {case.cls:12} {case.id:32} {line[:200]}", flush=True)
    print(f"{len(cases)} cases: " + ", ".join(f"{k} {counts[k]}" for k in KINDS))
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
