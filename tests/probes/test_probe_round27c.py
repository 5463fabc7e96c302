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
4. a line's stated range of an int field (int_ranges, for a value omegaconf refuses by its
   type) was read from the field's last name alone, and its default rule (a positive integer)
   stood for fields whose checks cap them (a model's widths, `sms`, `n_gpus`, `n_devices`, ...)
   or start lower (prefetch_eval's `k`, klotski's `attn_batches`). Every int field of every
   command's schema is tried at its stated ends and just past them against its check.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest

from experiments.common import typed_values as hydra_errors
from tests.probes import test_probe_round26c as r26c
from tests.probes import test_probe_round26c_gaps as g26
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
    """The other half: a value no override gave as such (a file's) is shown as held; a number
    the line holds that differs is left alone. (One point of a swept `1e300,2` is shown as
    typed since round 28c: test_probe_round28c.)"""
    hydra_errors.set_typed(["disk_mb=1e300,2", "scale=1e308"])
    try:
        assert hydra_errors.as_typed("disk_mb", "3e+300", at="") == "3e+300"
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


@pytest.mark.parametrize(
    "target",  # the launcher's and a rank's cases held before round 27c: the slow suite
    [
        pytest.param("launcher", marks=pytest.mark.slow),
        "forkserver",
        pytest.param("rank", marks=pytest.mark.slow),
    ],
)
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


# --- 4. every int field's stated range is the range its checks take ---

BIG = 2**62  # a value no check of a field without a highest may refuse


def _spec_model(name: str) -> Any:
    """ModelSpec's checks of model field `name`, the other fields set so the value alone
    decides (a top_k up to the most experts, a layer count with its first layer MoE)."""
    from core.spec import MAX_EXPERTS, ModelSpec
    from tests.conftest import conf

    def with_room(v: int) -> dict[str, Any]:
        if name == "n_layers":
            return {"n_layers": v, "moe_layers": [0], "dense_ffn_size": 1}
        if name == "top_k":
            return {"top_k": v, "n_experts": MAX_EXPERTS}
        if name == "n_kv_heads":
            return {"n_kv_heads": v, "n_heads": max(v, 1)}
        if name == "n_heads":
            return {"n_heads": v, "n_kv_heads": 1}
        if name == "n_experts":
            return {"n_experts": v, "top_k": 1}
        return {name: v}

    from core.spec_fields import FAMILY_ONLY

    families = FAMILY_ONLY.get(name, (("mixtral",), None))[0]  # a family that reads it
    own = {} if "mixtral" in families else {"family": families[0]}
    return lambda v: ModelSpec.from_dict(conf("model", "tiny") | own | with_room(v))


def _hardware(name: str) -> Any:
    """HardwareSpec's checks and what a machine can be (`check_physical`) of field `name`."""
    from core.hardware import HardwareSpec, check_physical
    from tests.conftest import conf

    def build(v: int) -> Any:
        hw = conf("hardware", "tiny")
        if name == "n_gpus":
            return check_physical(HardwareSpec.from_dict(hw | {"n_gpus": v}))
        room = {"sms": 10**6} if name != "sms" else {}
        gpu = dict(hw["gpu"]) | room | {name: v}
        return check_physical(HardwareSpec.from_dict(hw | {"gpu": gpu}))

    return build


def _replication(v: int) -> Any:
    """The replication block's check of its replica_slots (`ep_inputs.check_block`)."""
    from types import SimpleNamespace

    from experiments.common import ep_inputs

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ep_inputs, "expert_parallel_names", lambda: ["eplb"])
        return ep_inputs.check_block(
            {"routing": "synthetic", "replica_slots": v}, SimpleNamespace(planner="eplb", params={})
        )


def _bench_real_layers(v: int) -> Any:
    """bench.real's n_layers, against a model of the most layers any model has."""
    from types import SimpleNamespace

    from core.spec import MAX_LAYERS
    from experiments.bench import real

    def spec(model: str, **over: Any) -> Any:
        if over:
            raise g26._Accepted
        return SimpleNamespace(n_layers=MAX_LAYERS)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(real, "reduced_spec", spec)
        mp.setattr(real.pe, "checked_routing", lambda *a: None)
        mp.setattr(real, "checked_room", lambda *a: None)
        return real._checked(real.BenchRealOptions(model="tiny", budget_gb=1, n_layers=v))


def _host_repeats(v: int) -> Any:
    from experiments.bench import host
    from experiments.common.app import kv

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "kv_lines", g26._past)
        mp.setattr(host, "device_of", lambda *a: None, raising=False)
        return host.report(kv(host.Options()) | {"repeats": v})


def _planner_of(schema: type) -> str:
    """The first registered planner whose params `schema` is (`schema.params_schema`'s)."""
    from planners.registry import registered

    return next(
        n for n, e in registered().items() if f"{e.params.__name__}Schema" == schema.__name__
    )


def _check_of(cls: type, name: str) -> Any:
    """The check that takes int field `name` of schema `cls`, a call raising where refused."""
    from experiments.common.pool import checked_workers

    owner, module = cls.__name__, cls.__module__.removeprefix("experiments.")
    if owner == "MakeCheckpointOptions":  # (made from the model's schema: no module of its own)
        module = "make_checkpoint"
    if owner in ("ModelSchema", "MakeCheckpointOptions") and name != "seed":
        return _spec_model(name)
    if owner in ("HardwareSchema", "ComputeSchema"):
        return _hardware(name)
    if owner in ("WorkloadSchema",):
        return g26._workload(name)
    if owner == "RoutingSchema":
        return g26._hot_experts
    if owner == "ReplicationSchema":
        return _replication
    if owner.endswith("ParamsSchema"):
        return g26._params(_planner_of(cls), name)
    if owner == "BenchRealOptions":
        return _bench_real_layers if name == "n_layers" else g26._REAL(name)
    if owner == "BenchAccelerateOptions":
        return g26._ACCELERATE(name)
    simple = {
        "calibrate": lambda: g26._dict_check("calibrate", "_calibrate_main", "as_float")(name),
        "make_checkpoint": lambda: g26._opts_check(
            "make_checkpoint", "_write", "as_float", "Options", model="tiny", out="x"
        )(name),
        "prefetch_eval": lambda: g26._opts_check(
            "prefetch_eval", "_evaluated", "load_esft", "Options"
        )(name),
        "reproduce_klotski": lambda: lambda v: checked_workers(v, name),
        "routing_stats": lambda: g26._opts_check(
            "routing_stats", "_main", "output_file", "Options"
        )(name),
        "validate": lambda: g26._dict_check("validate", "_setup", "read_hardware", checkpoint="ck")(
            name
        ),
        "validate_lanes": lambda: g26._VALIDATE_LANES(name),
        "bench.sim": lambda: g26._opts_check("bench.sim", "_main", "bench", "Options")(name),
        "bench.lanes": lambda: g26._LANES(name),
        "bench.host": lambda: (
            g26._units
            if name == "units"
            else _host_repeats
            if name == "repeats"
            else g26._host(name)
        ),
    }
    return simple[module]()


def test_every_int_fields_stated_range_is_its_checks() -> None:
    """Class: a line's stated range of an int field (int_ranges, for a value omegaconf refuses
    by its type) apart from the check it speaks for: widths capped at MAX_WIDTH, `sms`,
    `n_gpus`, planner.params.n_devices and more were said to have no highest, bench.host's
    sizes none, prefetch_eval's `k` to start at 1 (0 = the trace's top-k), klotski's
    `attn_batches` likewise. For every int field of every command's schema (its groups' and
    the planners' params too), its check refuses the stated lowest - 1 and the highest + 1,
    and takes both ends (a field with no highest takes 2^62)."""
    from experiments.common.int_ranges import int_range

    wrong, tried = [], 0
    for cls, name in r26c._int_fields():
        if cls.__module__.startswith("hydra_plugins."):  # a launcher's own (check_n_jobs')
            continue
        low, high, _ = int_range(name, cls)
        check = _check_of(cls, name)
        ends = [low - 1, low, BIG if high is None else high, *([] if high is None else [high + 1])]
        said = {v: g26._refuses(check, v) for v in ends}
        want = {v: v < low or (high is not None and v > high) for v in ends}
        tried += 1
        if said != want:
            wrong.append((cls.__name__, name, (low, high), said))
    assert tried > 100
    assert not wrong, wrong
