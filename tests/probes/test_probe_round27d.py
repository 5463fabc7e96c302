"""Round 27d of issue 48: a fresh probe of the real half and of resumed sweeps
(`tests.probes.harness27d` over its `CASES`: distributed real runs with ranks killed and odd
devices, validate, calibrate and the benches on real checkpoints, hand-edited hardware
profiles, and `-m` sweeps stopped at random moments and run again). Classes found, one test
group each:

1. A distributed real run inside a joblib sweep (the default launcher) failed every point
   with `rank 0 died (exit code 1)`: the ranks' forkserver set the parent's start method as
   each rank started, loky's, which the server had never imported ("cannot find context for
   'loky'"). The server now imports the module that registers the parent's method.
2. A line's fix that, pasted as it reads, is an error of its own: a hardware profile without
   a link said to add `d2h: {gbps: ..., latency_us: ...}}`, a brace too many for YAML.
3. A rank started by hand whose MASTER_ADDR this machine cannot resolve, or whose MASTER_PORT
   is no port (abc, 99999, 0), waited out the rendezvous timeout and then said the group did
   not form, as if a rank had never joined. Both are named as the run starts.
4. A launch's WORLD_SIZE other than the schedule's devices was checked only once the group
   had formed: a rank by hand with WORLD_SIZE=3 for 2 devices waited out the rendezvous for a
   rank no one would start. It is checked before the rank joins.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import user_env
from tests.probes.conftest import ROOT, cli, one_line

LOKY_RANK = """
import multiprocessing as mp, os
import joblib.externals.loky.backend.context  # as a joblib worker has it
mp.set_start_method("loky", force=True)
from experiments.common import rank_server
p = rank_server.server_context().Process(target=os.getpid)
p.start()
p.join()
print("exit", p.exitcode)
"""


def test_a_rank_starts_where_the_parent_runs_in_a_joblib_worker() -> None:
    """A rank started from a process whose start method is loky's (a joblib sweep's worker)
    runs: it exited 1 at its start, before its own code, in every such sweep point."""
    r = subprocess.run(
        [sys.executable, "-c", LOKY_RANK],
        cwd=ROOT,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout.strip() == "exit 0", r.stderr[-2000:]
    assert "cannot find context" not in r.stderr


def test_a_missing_links_fix_pasted_in_is_the_link() -> None:
    """2. A hardware profile without a link said to add `d2h: {gbps: ..., latency_us: ...}}`:
    pasted in as it reads, that brace too many is a YAML error of its own. The fix it names,
    with numbers for its dots, now reads back as the link."""
    import re

    import yaml

    from core.errors import ConfigError
    from core.hardware import HardwareSpec

    d = yaml.safe_load((ROOT / "conf/hardware/tiny.yaml").read_text())
    del d["links"]["d2h"]
    with pytest.raises(ConfigError) as e:
        HardwareSpec.from_dict(d)
    fix = re.search(r"add (d2h: \{.*?\}+) under links", str(e.value))
    assert fix is not None, str(e.value)
    pasted = yaml.safe_load(fix.group(1).replace("...", "1.0"))
    d["links"].update(pasted)
    assert HardwareSpec.from_dict(d).links


@pytest.mark.parametrize(
    ("addr", "port", "named"),
    [
        ("nosuch.invalid", "29500", "MASTER_ADDR='nosuch.invalid': no such host"),
        ("127.0.0.1", "abc", "MASTER_PORT='abc' is not a port"),
        ("127.0.0.1", "99999", "MASTER_PORT='99999' is not a port"),
        ("127.0.0.1", "0", "MASTER_PORT='0' is not a port"),
    ],
)
def test_a_rank_by_hand_names_an_address_it_cannot_meet_at(
    monkeypatch: pytest.MonkeyPatch, addr: str, port: str, named: str
) -> None:
    """3. A rank started by hand (RANK, WORLD_SIZE set) at a MASTER_ADDR this machine cannot
    resolve, or a MASTER_PORT that is no port, waited out the rendezvous (120 s) and said
    "the process group did not form within ... s (a rank never joined ...)"; MASTER_PORT=0
    waited for ranks that could never find rank 0's port. Each is one line as the run starts."""
    from core.errors import ConfigError
    from experiments.common.launch_line import check_split_over_ranks

    env = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": addr, "MASTER_PORT": port}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError) as e:
        check_split_over_ranks("real", True)
    assert named in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    check_split_over_ranks("real", True)  # one it can meet at passes


def test_a_rank_by_hand_of_another_world_size_says_so_before_it_waits(
    tiny_ckpt: Path, tmp_path: Path
) -> None:
    """4. A rank started by hand with WORLD_SIZE=3 for a schedule of 2 devices waited out the
    rendezvous for a third rank no one would start, then said the group did not form (a
    torchrun launch of 3 said the count, once all 3 had joined). The count is checked before
    the rank joins: one line, at once (here well within the 60 s the rendezvous would take)."""
    env = {**user_env(), "RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29641"}  # fmt: skip
    args = ["executor=real", "executor.distributed=true", f"checkpoint={tiny_ckpt}",
            "planner=eplb", "hardware=h200-hgx8", "workload=tiny",
            "+planner.params.n_devices=2", "executor.rendezvous_timeout_s=60",
            f"hydra.run.dir={tmp_path / 'out'}"]  # fmt: skip
    r = cli("experiments.run", *args, env=env)
    line = one_line(r, "3 processes (WORLD_SIZE)", "2 devices")
    assert "did not form" not in line and not (tmp_path / "out").exists()


def test_the_case_list_covers_the_real_half_and_sweeps_with_over_150_cases() -> None:
    """The harness's cases, to run again: over 150, each class of this round, ids unique."""
    from collections import Counter

    from tests.probes.cases27d import CASES, SCENARIOS

    ids = Counter(c.id for c in [*CASES, *SCENARIOS])
    assert len(ids) > 150 and max(ids.values()) == 1
    classes = {c.cls for c in [*CASES, *SCENARIOS]}
    assert classes == {
        "dist", "torchrun", "ranks_killed", "real_cmds", "profile", "ckpt_change", "sweep",
        "sweep_stop",
    }  # fmt: skip


def test_a_sweeps_results_leave_out_hidden_folders_and_wall_time(tmp_path: Path) -> None:
    """`_results`, what a stopped sweep run again is compared by: each point's summary.json
    less its wall time, none from a hidden folder (a `.partial-*` one a kill left)."""
    import json

    from tests.probes.harness27d import _results

    for rel, wall in (("a/b", 1.0), ("a/.partial-1-x", 2.0)):
        (tmp_path / rel).mkdir(parents=True)
        (tmp_path / rel / "summary.json").write_text(json.dumps({"x": 1, "wall_s": wall}))
    assert _results(tmp_path) == {"a/b": {"x": 1}}
