"""Round 28d's probe harness (issue 48): the files every command reads and writes, over
`tests.probes.cases28d.CASES` (each run once and sorted by `tests.probes.harness26d.classify`)
and `SCENARIOS` (two commands writing one output at once; a command killed with SIGKILL in the
middle of its write, its earlier result then checked whole), each sorted into one of
`harness26d.KINDS`.

Usage: python -m tests.probes.harness28d [CLASS_OR_ID ...]   (one row a case, then counts)
"""

from __future__ import annotations

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
from typing import Any

from tests.conftest import user_env
from tests.probes import harness26d
from tests.probes.harness26d import KINDS, ROOT, _base, run_case

CK = ("model=mixtral-tiny", "n_layers=2", "hidden_size=64", "n_heads=4", "n_kv_heads=2",
      "expert_ffn_size=32", "vocab_size=128")  # fmt: skip


@dataclass(frozen=True)
class Writer:
    """A command that writes `out` (under the case's folder {t}), and how to tell that what it
    left there is whole (`whole(path)`: None, else what is wrong)."""

    id: str
    module: str
    args: tuple[str, ...]
    out: str
    whole: Callable[[Path], str | None]


def _json_whole(p: Path) -> str | None:
    try:
        json.loads(p.read_text())
    except (OSError, ValueError) as e:
        return f"{p.name}: {e}"
    return None


def _csv_whole(p: Path) -> str | None:
    import pandas as pd

    try:
        for name in ("results.csv", "results.parquet"):
            f = p / name
            df = pd.read_csv(f) if name.endswith("csv") else pd.read_parquet(f)
            if len(df) != 2:
                return f"{name}: {len(df)} rows, not 2"
    except (OSError, ValueError) as e:
        return f"{p.name}: {e}"
    return None


def _report_whole(p: Path) -> str | None:
    html = p / "index.html"
    if not html.is_file() or "</html>" not in html.read_text():
        return "index.html cut short or missing"
    return _csv_whole(p)


def _npz_whole(p: Path) -> str | None:
    import numpy as np

    try:
        with np.load(p) as z:
            [z[k] for k in z.files]
    except (OSError, ValueError, EOFError) as e:
        return f"{p.name}: {e}"
    return None


def _yaml_whole(p: Path) -> str | None:
    import yaml

    try:
        body = yaml.safe_load(p.read_text())
    except (OSError, ValueError, yaml.YAMLError) as e:
        return f"{p.name}: {e}"
    return None if isinstance(body, dict) and "name" in body else f"{p.name}: not a profile"


def _ckpt_whole(p: Path) -> str | None:
    from safetensors import safe_open

    try:
        json.loads((p / "config.json").read_text())
        for f in p.glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                [st.get_tensor(k) for k in st.keys()]  # noqa: SIM118
    except Exception as e:  # noqa: BLE001 (any failure to read it back is the finding)
        return f"{p.name}: {e}"
    return None


def _val_whole(p: Path) -> str | None:
    f = p / "validate.csv"
    return None if f.is_file() and f.read_text().count("\n") >= 2 else "validate.csv cut short"


def _dump(t: Path) -> None:
    from tests.probes.cases28d import _dump as dump

    dump(t)


WRITERS = (
    Writer("collect", "experiments.collect", ("dir={t}/sw", "out={t}/o"), "o", _csv_whole),
    Writer("report", "experiments.report", ("dir={t}/sw", "out={t}/o"), "o", _report_whole),
    Writer("trace_json", "experiments.trace_json", ("runs=[{run}]", "out={t}/o.json"), "o.json",
           _json_whole),
    Writer("convert", "experiments.convert_traces", ("src={t}/src", "out={t}/o.npz"), "o.npz",
           _npz_whole),
    Writer("make_ckpt", "experiments.make_checkpoint", (*CK, "out={t}/o"), "o", _ckpt_whole),
    Writer("calibrate", "experiments.calibrate", ("out={t}/o.yaml", "disk_dir={t}/cd",
                                                  "disk_mb=1"), "o.yaml", _yaml_whole),
    Writer("validate", "experiments.validate", ("checkpoint={ck}", "hardware=tiny", "repeats=1",
           "out={t}/o", "planners=[flexgen]", "gpu_frac=2"), "o", _val_whole),
)  # fmt: skip


def _prepared(t: Path, home: Path) -> None:
    base = _base(home)
    shutil.rmtree(t, ignore_errors=True)
    t.mkdir(parents=True)
    shutil.copytree(base["ck"], t / "ck")
    shutil.copytree(base["run"], t / "run")
    shutil.copytree(base["run"], t / "sw/a")
    shutil.copytree(base["run"], t / "sw/b")
    _dump(t)


def _cmd(w: Writer, t: Path) -> list[str]:
    return [sys.executable, "-m", w.module, *(a.replace("{t}", str(t)).replace(
        "{ck}", str(t / "ck")).replace("{run}", str(t / "run")) for a in w.args)]  # fmt: skip


def _start(w: Writer, t: Path) -> subprocess.Popen:
    return subprocess.Popen(_cmd(w, t), cwd=ROOT, env=user_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def killed(w: Writer, t: Path, home: Path, rng: random.Random) -> tuple[str, str]:
    """`w` run once, then again killed (SIGKILL) at a random moment of its run: the first
    result must still be whole (or the second's, whole)."""
    _prepared(t, home)
    first = subprocess.run(_cmd(w, t), cwd=ROOT, env=user_env(), capture_output=True, text=True)
    if first.returncode != 0:
        return "other", f"first run failed: {first.stderr.strip()[-200:]}"
    began = time.monotonic()
    subprocess.run(_cmd(w, t), cwd=ROOT, env=user_env(), capture_output=True)
    took = time.monotonic() - began
    p = _start(w, t)
    time.sleep(rng.uniform(0.4, 1.0) * took)
    p.send_signal(signal.SIGKILL)
    p.wait()
    problem = w.whole(t / w.out)
    return ("lost", problem) if problem else ("good", f"killed at {time.monotonic() - began:.1f}s")


def together(w: Writer, t: Path, home: Path, rng: random.Random) -> tuple[str, str]:
    """`w` run twice at once into one output: each ends in 0 or one line, the output whole."""
    _prepared(t, home)
    a = _start(w, t)
    time.sleep(rng.uniform(0, 0.5))
    b = _start(w, t)
    outs = [p.communicate(timeout=300) for p in (a, b)]
    for p, (_, err) in zip((a, b), outs, strict=True):
        lines = [x for x in err.splitlines() if x.strip()]
        if "Traceback" in err:
            return "traceback", lines[-1]
        if p.returncode != 0 and (len(lines) != 1 or not lines[0].startswith("error: ")):
            return "multiline", " | ".join(lines)[-200:]
    problem = w.whole(t / w.out)
    if problem:
        return "lost", problem
    said = [e.strip() for _, e in outs if e.strip()]
    return "good", (said[0] if said else "both finished")[:200]


SCENARIOS = [
    *((f"kill_{w.id}", "killed", w, killed) for w in WRITERS),
    *((f"both_{w.id}", "together", w, together) for w in WRITERS),
]


_classify = harness26d.classify
SKIPPERS = ("experiments.collect", "experiments.report")


def classify(case: Any, t: Path, r: subprocess.CompletedProcess, before: set[Path]) -> tuple:
    """harness26d's kinds, where a failure's warnings said before its `error: ` line (the
    project's rule: they may explain it) are not a multi-line error."""
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    if r.returncode != 0 and lines and lines[-1].startswith("error: "):
        # a logged warning: its level's word, or (Python's last-resort handler) a file's note
        kept = [x for x in lines if not x.startswith(("WARNING ", "warning: ", "/"))]
        r = subprocess.CompletedProcess(r.args, r.returncode, r.stdout, "\n".join(kept) + "\n")
    kind, line = _classify(case, t, r, before)
    skipped = [x for x in lines if x.startswith("skipped ")]
    if kind == "silent" and case.module in SKIPPERS and skipped and case.names:
        # a sweep's run it cannot read is skipped with a line, the others collected (designed,
        # docs/commands.md), where the line names the file and what is wrong with it
        named = case.names[0] in skipped[0] and "no summary.json (unfinished" not in skipped[0]
        return ("designed" if named else "wrong"), skipped[0]
    if kind == "designed" and case.module in SKIPPERS and "_tr_" in case.id and skipped:
        return "wrong", skipped[0]  # a run's trace (read only by figures) skips no run
    return kind, line


def main(selected: list[str]) -> Counter:
    from tests.probes.cases28d import CASES

    home = Path(tempfile.gettempdir()) / ("probe28d" + os.environ.get("PROBE28D_HOME", ""))
    home.mkdir(exist_ok=True)
    cases = [c for c in CASES if not selected or c.cls in selected or c.id in selected]
    scen = [s for s in SCENARIOS if not selected or s[1] in selected or s[0] in selected]
    counts: Counter = Counter()
    rng = random.Random(28)
    harness26d.classify = classify  # run_case's (only while this probe runs)
    for case in cases:
        kind, line = run_case(case, home)
        counts[kind] += 1
        print(f"{kind:10} {case.cls:12} {case.id:32} {line[:220]}", flush=True)
    for sid, cls, w, fn in scen:
        kind, line = fn(w, home / sid, home, rng)
        counts[kind] += 1
        print(f"{kind:10} {cls:12} {sid:32} {line[:220]}", flush=True)
    print(f"{len(cases) + len(scen)} cases: " + ", ".join(f"{k} {counts[k]}" for k in KINDS))
    return counts


if __name__ == "__main__":
    main(sys.argv[1:])
