"""Round 27c of issue 48: the lines and ranges left from rounds 26c and 26f, one class a group:
1. a value refused on the command line was shown in omegaconf's or Python's form (`disk_mb=
   1e+300`, `n_gpus=1e+09`), not as typed (`1e300`, `1000000000`): a user could not find it
   in their command. A number an override gave is shown as typed, in every line.
2. a newline (or a tab, any control character) inside an override (bash's $'...', a line
   break pasted into the command) gave a fix holding `\\n`, which pasted is the two characters
   \\ and n, not the newline. Such an override is one line saying what it holds, with a fix
   that pastes as one argument, which the command then takes.
3. the forkserver that a distributed run's ranks fork from kept SIGTERM blocked, so `kill` of
   it alone was held for ever and the run went on to write its result. A SIGTERM to any one
   process of the run (launcher, forkserver, a rank) ends the whole run in one line, tested
   end to end on a 2-rank gloo run.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from experiments.common import typed_values as hydra_errors
from tests.probes.conftest import one_line

TINY = ["model=tiny", "hardware=tiny", "workload=tiny"]
NOWHERE = "hydra.run.dir=/nonexistent/r27c"

# --- 1. a refused value shown as typed ---


@pytest.mark.parametrize(
    ("module", "args", "said"),
    [
        ("experiments.calibrate", ["disk_mb=1e300", NOWHERE], "disk_mb=1e300: must be"),
        ("experiments.calibrate", ["disk_mb=2.50", NOWHERE], "disk_mb=2.50: must be"),
        ("experiments.calibrate", ["disk_mb='1e300'", NOWHERE], "disk_mb='1e300': must be"),
        ("experiments.run", [*TINY, "workload.batch_size=2.50", NOWHERE], "batch_size=2.50:"),
        ("experiments.run", [*TINY, "hardware.n_gpus=1000000000", NOWHERE], "n_gpus=1000000000 "),
        ("experiments.run", [*TINY, "hardware.links.h2d.gbps=1e308", NOWHERE], "gbps=1e308 "),
        ("experiments.make_checkpoint", ["model=tiny", "scale=1e308", "out=/x/ck"], "scale=1e308:"),
    ],
)
def test_a_refused_value_is_shown_as_typed(
    cli_here: Any, module: str, args: list[str], said: str
) -> None:
    """Class: a line showed the value as omegaconf or Python holds it (`1e+300`, `1e+09`),
    not as the user typed it on the command line."""
    one_line(cli_here(module, *args), said)


def test_a_value_from_a_file_or_a_sweep_is_shown_as_held() -> None:
    """The other half: a value no override gave as such (a file's, one point of a swept
    `1e300,2`) is shown as held; a number the line holds that differs is left alone."""
    hydra_errors.set_typed(["disk_mb=1e300,2", "scale=1e308"])
    try:
        assert hydra_errors.as_typed("disk_mb", "1e+300", at="") == "1e+300"
        assert hydra_errors.as_typed("scale", "1e+308", at=" (in conf/x.yaml)") == "1e+308"
        assert hydra_errors.with_typed("scale=1e+308 or scale=2.5") == "scale=1e308 or scale=2.5"
    finally:
        hydra_errors.set_typed([])


# --- 2. a control character inside an override ---


def _bash_words(shown: str) -> list[str]:
    """The arguments bash hands a command for `shown` pasted after it, as it stands."""
    r = subprocess.run(
        ["bash", "--norc", "-c", f"printf '%s\\0' {shown}"], capture_output=True, check=True
    )
    return r.stdout.decode().split("\0")[:-1]


FIX = "pass it on one line: "


@pytest.mark.parametrize(
    ("module", "given", "sep", "rest"),
    [
        ("experiments.make_checkpoint", "out={tmp}/a b", "\n", ["model=tiny"]),
        ("experiments.make_checkpoint", "out={tmp}/a#b", "\n", ["model=tiny"]),
        ("experiments.make_checkpoint", "out={tmp}/it's", "\r\n", ["model=tiny"]),
        ("experiments.make_checkpoint", "out={tmp}/ab", "\t", ["model=tiny"]),
        ("experiments.run", "model.name=ab", "\n", [*TINY, "hydra.run.dir={tmp}/run"]),
        ("experiments.collect", "dir={tmp}/ab", "\x1b", []),
    ],
    ids=["newline", "newline-hash", "crlf-quote", "tab", "run-name", "escape"],
)
def test_a_control_character_in_an_override_has_a_fix_that_pastes(
    cli_here: Any, tmp_path: Path, module: str, given: str, sep: str, rest: list[str]
) -> None:
    """Class: a fix holding `\\n` (`"model.name='a\\nb'"`): pasted, the command got a
    backslash and an n. The line says what the value holds; its fix, through shlex and bash,
    is one argument without it, and the command takes that argument."""
    rest = [r.format(tmp=tmp_path) for r in rest]
    meant = given.format(tmp=tmp_path)
    key, _, value = meant.partition("=")
    cut = len(value) // 2 + 1
    typed = f"{key}={value[:cut]}{sep}{value[cut:]}"
    line = one_line(cli_here(module, *rest, typed), "which no option takes", FIX)
    shown = line.partition(FIX)[2]
    words = shlex.split(shown)
    assert words == _bash_words(shown) and len(words) == 1, line
    assert not any(ord(c) < 32 for c in line), line
    again = cli_here(module, *rest, words[0])
    assert "no option takes" not in again.stderr, again.stderr
    if module == "experiments.make_checkpoint":  # it wrote the checkpoint where it was meant
        assert again.returncode == 0, again.stderr
        assert (Path(value) / "config.json").is_file(), again.stderr


# --- 3. SIGTERM to any one process of a distributed run ---


def _alive(pids: list[int]) -> list[int]:
    """Which of `pids` `ps` still lists (a zombie, dead but not yet reaped by init, is not)."""
    out = subprocess.run(
        ["ps", "-o", "pid=,stat=", "-p", ",".join(map(str, pids))], capture_output=True, text=True
    ).stdout
    return [int(p) for p, stat in (row.split()[:2] for row in out.splitlines()) if stat[0] != "Z"]


@pytest.mark.parametrize("target", ["launcher", "forkserver", "rank"])
def test_sigterm_to_any_one_process_of_a_distributed_run_ends_it(
    target: str, tmp_path: Path, tiny_ckpt: Path
) -> None:
    """Class: a SIGTERM to one process of a 2-rank gloo run. The forkserver (the ranks'
    parent) kept SIGTERM blocked, so `kill` of it alone was held for ever and the run went on to
    write its result (tested before by its signal masks only). Whichever process gets it (the
    launcher, the forkserver, a rank), the whole run ends: one line, a non-zero exit, no
    summary.json, and `ps` lists none of its processes after."""
    import os
    import signal
    import time

    from tests.conftest import spawned_ranks, started

    run = tmp_path / "run"
    p = started(
        "experiments.run",
        "executor=real",
        "executor.distributed=true",
        "hardware=h200-hgx8",
        "workload=tiny",
        "planner=eplb",
        "+planner.params.n_devices=2",
        f"checkpoint={tiny_ckpt}",
        "workload.n_batches=40",
        "workload.gen_len=40",
        f"hydra.run.dir={run}",
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    ranks: list[int] = []
    deadline = time.monotonic() + 120
    while len(ranks) < 2 and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
        ranks = spawned_ranks(p.pid)
    assert len(ranks) == 2, p.communicate()
    server = int(Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill({"launcher": p.pid, "forkserver": server, "rank": ranks[1]}[target], signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    lines = [line for line in err.splitlines() if line.strip()]
    assert p.returncode != 0 and "Traceback" not in err, err
    assert len(lines) == 1, err
    said = "rank 1 died (signal 15, SIGTERM)" if target == "rank" else "stopped by SIGTERM; "
    assert said in lines[0], err
    assert not (run / "summary.json").exists()
    gone = time.monotonic() + 5  # killed with the command (PR_SET_PDEATHSIG), within moments
    while _alive([server, *ranks]) and time.monotonic() < gone:
        time.sleep(0.05)
    assert not _alive([server, *ranks]), "processes of the run left running"
