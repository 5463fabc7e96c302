"""Round 27d's probe cases (issue 48), run by `tests.probes.harness27d`: the real half and
sweeps as a failing machine would meet them (distributed runs and torchrun, validate,
calibrate, the benches, make_checkpoint and convert_traces on tiny real checkpoints,
hand-edited hardware profiles, checkpoints changed between runs, sweeps stopped and run
again), none of earlier rounds' cases.

Usage: python -m tests.probes.harness27d [CLASS_OR_ID ...]
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.conftest import overridden, user_env
from tests.probes.cases26d import MK, REAL, RUN, both, config, text
from tests.probes.harness26d import ROOT, Case
from tests.probes.harness27d import DIST, Scenario, kill_rank, stop_sweep

OUT = "hydra.run.dir={t}/out"
XFSZ = "trap '' XFSZ; ulimit -f 8;"
VAL, CAL = "experiments.validate", "experiments.calibrate"
ACC, BREAL = "experiments.bench.accelerate", "experiments.bench.real"
CONV, TR = "experiments.convert_traces", "experiments.torchrun"
V = (
    "checkpoint={ck}",
    "hardware=tiny",
    "repeats=1",
    "out={t}/v",
    "planners=[flexgen]",
    "gpu_frac=2",
)  # fmt: skip  (the tiny checkpoint's flexgen runs at these)
C = ("out={t}/cal.yaml", "disk_dir={t}/cd", "disk_mb=1")  # a tiny checkpoint's in-run runs
# do not fit the share calibrate gives them: it calibrates without one
A = ("checkpoint={ck}", "hardware=tiny", "repeats=1", "n_batches=1")
HOLD = (  # a process listening on port 29617 for a minute
    'python3 -c \'import socket,time;s=socket.socket();s.bind(("127.0.0.1",29617));'
    "s.listen();time.sleep(60)' & sleep 1;"
)


def dist(i: str, *more: str, names: tuple[str, ...] = (), **kw: object) -> Case:
    args = tuple(overridden((*DIST, OUT), *more))
    return Case(f"dist_{i}", "dist", RUN, args, names=names, **kw)  # type: ignore[arg-type]


def real_run_first(t: Path) -> None:
    """A finished real run of the case's checkpoint in {t}/out, as a user's earlier run."""
    subprocess.run(
        [sys.executable, "-m", RUN, *(a.format(ck=t / "ck", t=t) for a in REAL)],
        cwd=ROOT, env=user_env(), capture_output=True, check=True,
    )  # fmt: skip


def shard(edit: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(t: Path) -> None:
        edit(t / "ck" / "model.safetensors")

    return setup


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _dist_cases() -> list[Case]:
    d = "+planner.params.n_devices"
    return [
        dist("n3", f"{d}=3", names=("n_devices",)),
        dist("n_neg", f"{d}=-1", names=("n_devices",)),
        dist("n_float", f"{d}=1.5", names=("n_devices",)),
        dist("n_word", f"{d}=two", names=("n_devices",)),
        dist("n_huge", f"{d}=1000000000000", names=("n_devices",)),
        dist("n_null", f"{d}=null", names=("n_devices",)),
        dist("rdv_neg", "executor.rendezvous_timeout_s=-1", names=("rendezvous_timeout_s",)),
        dist("rdv_inf", "executor.rendezvous_timeout_s=inf", names=("rendezvous_timeout_s",)),
        dist("rdv_word", "executor.rendezvous_timeout_s=soon", names=("rendezvous_timeout_s",)),
        dist("rdv_huge", "executor.rendezvous_timeout_s=1e12", names=("rendezvous_timeout_s",)),
        dist("flag_word", "executor.distributed=maybe", names=("distributed",)),
        dist("flag_int", "executor.distributed=2", names=("distributed",)),
        Case("dist_flexgen", "dist", RUN, (*REAL, "executor.distributed=true"),
             names=("flexgen",)),
        dist("experts_over", "+planner.params.n_devices=9", names=("n_devices",)),
        dist("n_cores", "+planner.params.n_devices=4", names=("n_devices",)),
        dist("klotski", "planner=klotski", names=("planner",)),
        dist("dense_bad", "+planner.params.dense=nosuch", names=("dense",)),
        dist("dense_tensor", "+planner.params.dense=tensor", expect="ok"),
        dist("mode_bad", "executor.routing_mode=nosuch", names=("routing_mode",)),
        dist("shard_gone", setup=shard(lambda p: p.unlink()), names=("model.safetensors",)),
        dist("shard_half", setup=shard(_truncate), names=("model.safetensors",)),
        dist("cfg_experts", setup=config(num_local_experts=4), names=("experts.4",)),
        dist("cfg_gone", setup=lambda t: (t / "ck" / "config.json").unlink(),
             names=("config.json",)),
        dist("efbig", shell=XFSZ, names=("out",)),
        dist("nofile", shell="ulimit -n 24;", names=("ulimit",)),
        # Python's tempfile takes the next usable folder (/tmp) for an unusable TMPDIR
        dist("tmp_gone", extra={"TMPDIR": "/nonexistent/tmp"}, expect="ok"),
        dist("tmp_file", extra={"TMPDIR": "/etc/hostname"}, expect="ok"),
        dist("gloo_if", extra={"GLOO_SOCKET_IFNAME": "nosuch0"}, names=("GLOO_SOCKET_IFNAME",)),
        dist("out_file", "hydra.run.dir={t}/f", setup=text("f", "x"), names=("f",)),
        dist("out_ro", "hydra.run.dir=/proc/x", names=("/proc/x",)),
        dist("threads_bad", extra={"OMP_NUM_THREADS": "0"}, names=("OMP_NUM_THREADS",)),
        dist("over_run", setup=real_run_first, expect="ok"),
        dist("hand_rank", extra={"RANK": "0", "WORLD_SIZE": "2"}, names=("MASTER_ADDR",)),
        dist("hand_addr", extra={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "nosuch.invalid",
                                  "MASTER_PORT": "29618"}, names=("nosuch.invalid",)),
        dist("hand_port", extra={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": "29617"}, shell=HOLD, names=("MASTER_PORT",)),
        dist("hand_port_word", extra={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": "abc"}, names=("MASTER_PORT",)),
        dist("hand_port0", extra={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "0"}, names=("MASTER_PORT",)),
        dist("hand_world", extra={"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": "29619"}, names=("WORLD_SIZE",)),
        dist("hand_rank_over", extra={"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": "29619"}, names=("RANK",)),
    ]  # fmt: skip


def tr(i: str, *flags: str, more: tuple[str, ...] = (), **kw: object) -> Case:
    args = (*flags, "-m", RUN, *overridden((*DIST, OUT), *more))
    return Case(f"tr_{i}", "torchrun", TR, args, **kw)  # type: ignore[arg-type]


def _torchrun_cases() -> list[Case]:
    one = ("--nnodes=1", "--nproc_per_node=2")
    return [
        tr("addr", *one, "--master_addr=nosuch.invalid", "--master_port=29620",
           names=("nosuch.invalid",)),
        tr("port", *one, "--master_addr=127.0.0.1", "--master_port=29617", shell=HOLD,
           names=("29617",)),
        tr("nproc3", "--standalone", "--nproc_per_node=3", names=("n_devices",)),
        # a launch of 1 is the command itself, which starts the schedule's 2 ranks
        tr("nproc1", "--standalone", "--nproc_per_node=1", expect="ok"),
        tr("n3", "--standalone", "--nproc_per_node=2", more=("+planner.params.n_devices=3",),
           names=("n_devices",)),
        tr("restarts", "--standalone", "--nproc_per_node=2", "--max-restarts=-1",
           names=("max",)),
        tr("shard_gone", "--standalone", "--nproc_per_node=2",
           setup=shard(lambda p: p.unlink()), names=("model.safetensors",)),
        tr("efbig", "--standalone", "--nproc_per_node=2", shell=XFSZ, names=("out",)),
        tr("ok", "--standalone", "--nproc_per_node=2", expect="ok"),
        tr("rdzv_timeout", "--standalone", "--nproc_per_node=2", "--rdzv_conf=join_timeout=0",
           names=("join_timeout",)),
    ]  # fmt: skip


def _validate_cases() -> list[Case]:
    def v(i: str, *more: str, names: tuple[str, ...] = (), **kw: object) -> Case:
        args = tuple(overridden(V, *more))
        return Case(f"val_{i}", "real_cmds", VAL, args, names=names, **kw)  # type: ignore[arg-type]

    return [
        v("gf0", "gpu_frac=0", names=("gpu_frac",)),
        v("gf_neg", "gpu_frac=-0.1", names=("gpu_frac",)),
        v("gf_big", "gpu_frac=1.5", names=("gpu_frac",)),  # its KV cache does not fit then
        v("gf_over", "gpu_frac=65", names=("gpu_frac",)),
        v("gf_nan", "gpu_frac=nan", names=("gpu_frac",)),
        v("gf_tiny", "gpu_frac=1e-9", names=("gpu_frac",)),
        v("cf_neg", "cpu_frac=-1", names=("cpu_frac",)),
        v("cf_big", "cpu_frac=2", expect="ok"),  # a share of the model's bytes, up to 64
        v("cf_nan", "cpu_frac=nan", names=("cpu_frac",)),
        v("gf_small", "gpu_frac=0.01", names=("gpu_frac",)),
        v("rep0", "repeats=0", names=("repeats",)),
        v("rep_neg", "repeats=-1", names=("repeats",)),
        v("rep_float", "repeats=1.5", names=("repeats",)),
        v("links_bad", "links=nosuch", names=("links",)),
        v("planner_bad", "planners=[nosuch]", names=("nosuch",)),
        v("planner_str", "planners=flexgen", expect="ok"),  # one planner, as [flexgen]
        v("bs0", "batch_size=0", names=("batch_size",)),
        v("nb0", "n_batches=0", names=("n_batches",)),
        v("pl0", "prompt_len=0", names=("prompt_len",)),
        v("gl0", "gen_len=0", names=("gen_len",)),
        v("pl_huge", "prompt_len=10000000", names=("prompt_len",)),
        v("dtype_bad", "executor.dtype=float8", names=("dtype",)),
        v("dist_flexgen", "executor.distributed=true", "planners=[flexgen]",
          names=("distributed",)),
        v("out_file", setup=text("v", "x"), names=("v",)),
        v("shard_half", setup=shard(_truncate), names=("model.safetensors",)),
        v("shard_gone", setup=shard(lambda p: p.unlink()), names=("model.safetensors",)),
        v("no_ckpt", names=("checkpoint",), setup=lambda t: __import__("shutil").rmtree(t / "ck")),
        v("hw_missing", "hardware=/nonexistent.yaml", names=("nonexistent",)),
        v("param_bad", "+planner_params.nosuch=1", names=("nosuch",)),
    ]  # fmt: skip


def _calibrate_cases() -> list[Case]:
    def c(i: str, *more: str, names: tuple[str, ...] = (), **kw: object) -> Case:
        args = tuple(overridden(C, *more))
        return Case(f"cal_{i}", "real_cmds", CAL, args, names=names, **kw)  # type: ignore[arg-type]

    return [
        c("disk_float", "disk_mb=1.5", names=("disk_mb",)),
        c("in_run_word", "in_run_s=soon", names=("in_run_s",)),
        c("name_dots", "hardware.name=..", names=("hardware.name",)),
        c("out_dir", "out={t}", names=("out",)),
        c("out_proc", "out=/proc/x.yaml", names=("/proc/x.yaml",)),
        c("dev_cuda_x", "device=cuda:x", names=("device",)),
        c("dtype_bad", "executor.dtype=int8", names=("dtype",)),
        Case("cal_shard_half", "real_cmds", CAL, ("checkpoint={ck}", *C[:2]),
             setup=shard(_truncate), names=("model.safetensors",)),
        Case("cal_tiny_ckpt", "real_cmds", CAL, ("checkpoint={ck}", *C[:2]),
             names=("checkpoint",)),
        c("disk_ro", "disk_dir=/proc/sys", names=("disk_dir",)),
        c("efbig", shell=XFSZ, names=("calib",)),
    ]  # fmt: skip


def _bench_cases() -> list[Case]:
    def a(i: str, *more: str, names: tuple[str, ...] = (), **kw: object) -> Case:
        args = tuple(overridden(A, *more))
        return Case(f"acc_{i}", "real_cmds", ACC, args, names=names, **kw)  # type: ignore[arg-type]

    def b(i: str, *more: str, names: tuple[str, ...] = ()) -> Case:
        args = tuple(overridden(("model=mixtral-tiny", "out_dir={t}/br", "peers=none"), *more))
        return Case(f"breal_{i}", "real_cmds", BREAL, args, names=names, timeout=120)

    return [
        a("gf0", "gpu_frac=0", names=("gpu_frac",)),
        a("cf_neg", "cpu_frac=-0.5", names=("cpu_frac",)),
        a("slack_neg", "slack_mb=-1", names=("slack_mb",)),
        a("margin_neg", "room_margin_mb=-1", names=("room_margin_mb",)),
        a("kn_neg", "klotski_n=-2", names=("klotski_n",)),
        a("rep0", "repeats=0", names=("repeats",)),
        a("nb0", "n_batches=0", names=("n_batches",)),
        a("cold_bad", "cold=maybe", names=("cold",)),
        a("room_bad", "room=nosuch", names=("room",)),
        a("cgroup_bad", "cgroup=maybe", names=("cgroup",)),
        a("routing_bad", "routing=nosuch", names=("routing",)),
        a("peer_nan", "peer_limit=nan", names=("peer_limit",)),
        a("planner_bad", "planner=nosuch", names=("nosuch",)),
        a("shard_gone", setup=shard(lambda p: p.unlink()), names=("model.safetensors",)),
        a("kattn_neg", "klotski_attn=-1", names=("klotski_attn",)),
        b("budget0", "budget_gb=0", names=("budget_gb",)),
        b("budget_neg", "budget_gb=-1", names=("budget_gb",)),
        b("budget_nan", "budget_gb=nan", names=("budget_gb",)),
        b("budget_tiny", "budget_gb=1e-9", names=("budget_gb",)),
        b("budget_huge", "budget_gb=1e9", names=("budget_gb",)),
        b("model_bad", "model=nosuch", "budget_gb=1", names=("nosuch",)),
        b("layers0", "budget_gb=1", "n_layers=0", names=("n_layers",)),
        b("layers_big", "budget_gb=1", "n_layers=1000", names=("n_layers",)),
        b("calib0", "budget_gb=1", "calib_layers=0", names=("calib_layers",)),
        b("peers_bad", "budget_gb=1", "peers=nosuch", names=("peers",)),
        b("slack_neg", "budget_gb=1", "slack_mb=-5", names=("slack_mb",)),
        b("n_neg", "budget_gb=1", "n=-3", names=("n",)),
    ]  # fmt: skip


def _make_convert_cases() -> list[Case]:
    ck = ("model=mixtral-tiny", "out={t}/ck2", "n_layers=2", "hidden_size=64",
          "expert_ffn_size=32", "vocab_size=128")  # fmt: skip

    def m(i: str, *more: str, names: tuple[str, ...] = (), **kw: object) -> Case:
        args = tuple(overridden(ck, *more))
        return Case(f"mk_{i}", "real_cmds", MK, args, names=names, **kw)  # type: ignore[arg-type]

    def cv(i: str, *args: str, names: tuple[str, ...] = (), **kw: object) -> Case:
        return Case(f"conv_{i}", "real_cmds", CONV, args, names=names, **kw)  # type: ignore[arg-type]

    return [
        m("scale0", "scale=0", names=("scale",)),
        m("scale_nan", "scale=nan", names=("scale",)),
        m("shard0", "shard_mb=0", names=("shard_mb",)),
        m("shard_neg", "shard_mb=-1", names=("shard_mb",)),
        m("shard_tiny", "shard_mb=0.001", names=("shard_mb",)),
        m("experts0", "n_experts=0", names=("n_experts",)),
        m("topk_over", "top_k=9", names=("top_k",)),
        m("heads_odd", "n_heads=3", names=("n_heads",)),
        m("vocab0", "vocab_size=0", names=("vocab_size",)),
        m("seed_float", "seed=1.5", names=("seed",)),
        m("over_run", "out={run}", names=("run",)),
        m("efbig", shell=XFSZ, names=("ck2",)),
        m("out_proc", "out=/proc/ck", names=("/proc/ck",)),
        m("rope_bad", "rope_scaling={type: nosuch, factor: 2}", names=("rope_scaling",)),
        cv("src_none", "src={t}/nosuch", "out={t}/o.npz", names=("nosuch",)),
        cv("src_empty", "src={t}/e", "out={t}/o.npz", setup=lambda t: (t / "e").mkdir(),
           names=("e",)),
        cv("src_txt", "src={t}/x.txt", "out={t}/o.npz", setup=text("x.txt", "1 2 3\n"),
           names=("x.txt",)),
        cv("src_badtar", "src={t}/x.tar.gz", "out={t}/o.npz", setup=text("x.tar.gz", b"\x1f\x8b00"),
           names=("x.tar.gz",)),
        cv("out_proc", "src={t}/e", "out=/proc/o.npz", setup=lambda t: (t / "e").mkdir(),
           names=("e",)),
    ]  # fmt: skip


HW = text("hw.yaml", (ROOT / "conf/hardware/tiny.yaml").read_text())
SIM_HW = ("model=tiny", "workload=tiny", "planner=flexgen", "hardware={t}/hw.yaml", OUT)


def hw(i: str, old: str, new: str, *names: str, real: bool = False, expect: str = "fail") -> Case:
    """The tiny profile with `old` edited to `new`, by a run (real: a validate)."""

    def setup(t: Path) -> None:
        HW(t)
        path = t / "hw.yaml"
        body = path.read_text()
        assert old in body, old
        path.write_text(body.replace(old, new, 1))

    if real:
        args = tuple(overridden(V, "hardware={t}/hw.yaml"))
        return Case(f"hwv_{i}", "profile", VAL, args, setup=setup, names=names, expect=expect)
    return Case(f"hw_{i}", "profile", RUN, SIM_HW, setup=setup, names=names, expect=expect)


def _profile_cases() -> list[Case]:
    h2d = "h2d: {gbps: 1.0, latency_us: 0}"
    return [
        hw("h2d_zero", h2d, "h2d: {gbps: 0, latency_us: 0}", "h2d"),
        hw("h2d_str", h2d, "h2d: {gbps: fast, latency_us: 0}", "h2d"),
        hw("h2d_list", h2d, "h2d: [1.0, 0]", "h2d"),
        hw("h2d_null", h2d, "h2d: null", "h2d"),
        hw("lat_nan", h2d, "h2d: {gbps: 1.0, latency_us: .nan}", "latency_us"),
        hw("lat_inf", h2d, "h2d: {gbps: 1.0, latency_us: .inf}", "latency_us"),
        hw("link_extra", h2d, h2d + "\n  nvme: {gbps: 1.0, latency_us: 0}", "nvme"),
        hw("gbps_missing", h2d, "h2d: {latency_us: 0}", "gbps"),
        hw("mem_str", "memory_gb: {gpu: 1.0", "memory_gb: {gpu: lots", "gpu"),
        hw("mem_missing", "memory_gb: {gpu: 1.0, cpu: 4.0, disk: 100.0}\n", "", "memory_gb"),
        hw("gpu_neg_bw", "mem_bw_gbps: 1000.0", "mem_bw_gbps: -1000.0", "mem_bw_gbps"),
        hw("cpu_nan_tflops", "cpu: {tflops: 0.1", "cpu: {tflops: .nan", "tflops"),
        hw("name_int", "name: tiny", "name: 7", expect="ok"),  # read as the name "7"
        hw("dup_key", "name: tiny", "name: tiny\nname: tiny2", "name"),
        hw("tab", "name: tiny", "name:\ttiny\n\tx: 1", "hw.yaml"),
        hw("v_neg_bw", h2d, "h2d: {gbps: -1.0, latency_us: 0}", "h2d", real=True),
        hw("v_nan_bw", h2d, "h2d: {gbps: .nan, latency_us: 0}", "h2d", real=True),
        hw("v_missing", h2d, "", "h2d", real=True),
        Case("hw_empty", "profile", RUN, SIM_HW, setup=text("hw.yaml", ""), names=("hw.yaml",)),
        Case("hw_list", "profile", RUN, SIM_HW, setup=text("hw.yaml", "- 1\n"),
             names=("hw.yaml",)),
        Case("hw_binary", "profile", RUN, SIM_HW, setup=text("hw.yaml", b"\xff\xfe\x00"),
             names=("hw.yaml",)),
    ]  # fmt: skip


def _between_runs_cases() -> list[Case]:
    def again(i: str, edit: Callable[[Path], None], *names: str, expect: str = "fail") -> Case:
        return Case(f"chg_{i}", "ckpt_change", RUN, REAL, setup=both(real_run_first, edit),
                    names=names, expect=expect)  # fmt: skip

    def reseeded(t: Path) -> None:
        args = (
            "model=mixtral-tiny",
            f"out={t}/ck",
            "seed=5",
            "n_layers=2",
            "hidden_size=64",
            "n_heads=4",
            "n_kv_heads=2",
            "expert_ffn_size=32",
            "vocab_size=128",
        )
        subprocess.run([sys.executable, "-m", MK, *args], cwd=ROOT, env=user_env(), check=True,
                       capture_output=True)  # fmt: skip

    def rerun_is_new(t: Path) -> str | None:  # the second run's tokens are the new weights'
        log = (t / "out" / "run.log").read_text()
        return "silent" if "skipping" in log or "already finished" in log else None

    return [
        again("shard_half", shard(_truncate), "model.safetensors"),
        again("shard_gone", shard(lambda p: p.unlink()), "model.safetensors"),
        again("cfg_edit", config(rms_norm_eps=1e-3), expect="ok"),
        again("cfg_gone", lambda t: (t / "ck" / "config.json").unlink(), "config.json"),
        Case("chg_reseeded", "ckpt_change", RUN, REAL, setup=both(real_run_first, reseeded),
             expect="ok", after=rerun_is_new),
        again("summary_nan", lambda t: _nan_summary(t / "out"), expect="ok"),
    ]  # fmt: skip


def _nan_summary(run: Path) -> None:
    s = json.loads((run / "summary.json").read_text())
    s["throughput_tok_s"] = float("nan")
    (run / "summary.json").write_text(json.dumps(s))


def _sweep_cases() -> list[Case]:
    sw = ("-m", "model=tiny", "hardware=tiny", "workload=tiny", "planner=flexgen",
          "workload.gen_len=2,3", "hydra.sweep.dir={t}/s")  # fmt: skip

    def earlier(over: str) -> Callable[[Path], None]:
        def setup(t: Path) -> None:
            args = overridden([a.replace("{t}", str(t)) for a in sw], over)
            subprocess.run([sys.executable, "-m", RUN, *args], cwd=ROOT, env=user_env(),
                           capture_output=True, check=True)  # fmt: skip

        return setup

    def no_mix(t: Path) -> str | None:  # each point's folder holds the config it names
        for c in (t / "s").rglob("config.yaml"):
            if ".hydra" not in c.parts:
                seed = "3" if "seed=3" in str(c) else "4"
                if f"seed: {seed}" not in c.read_text():
                    return "other"
        return None

    def edited_profile(t: Path) -> None:
        HW(t)
        earlier("hardware={t}/hw.yaml".replace("{t}", str(t)))(t)
        path = t / "hw.yaml"
        path.write_text(path.read_text().replace("h2d: {gbps: 1.0", "h2d: {gbps: 2.0"))

    def profile_rerun(t: Path) -> str | None:  # every point ran again at the edited profile
        configs = [c for c in (t / "s").rglob("config.yaml") if ".hydra" not in c.parts]
        return None if configs and all("gbps: 2.0" in c.read_text() for c in configs) else "other"

    return [
        Case("sw_changed_seed", "sweep", RUN, (*sw, "workload.seed=4"),
             setup=earlier("workload.seed=3"), expect="ok", after=no_mix),
        Case("sw_edited_profile", "sweep", RUN, tuple(overridden(sw, "hardware={t}/hw.yaml")),
             setup=edited_profile, expect="ok", after=profile_rerun),
        Case("sw_other_points", "sweep", RUN, (*sw[:-2], "workload.gen_len=3,4", sw[-1]),
             setup=earlier("workload.seed=0"), expect="ok"),
        Case("sw_dist_joblib", "sweep", RUN,
             ("-m", *DIST, "workload.gen_len=2,3", "hydra.sweep.dir={t}/s"), expect="ok"),
        Case("sw_real_joblib", "sweep", RUN,
             ("-m", *overridden(REAL[:-1], "planner=flexgen,klotski"), "hydra.sweep.dir={t}/s"),
             expect="ok"),
    ]  # fmt: skip


CASES = [
    *_dist_cases(), *_torchrun_cases(), *_validate_cases(), *_calibrate_cases(),
    *_bench_cases(), *_make_convert_cases(), *_profile_cases(), *_between_runs_cases(),
    *_sweep_cases(),
]  # fmt: skip

_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
SCENARIOS = [
    *(Scenario(f"kill_rank_{s.name}_{i}", "ranks_killed", kill_rank(s))
      for s in _SIGNALS for i in range(2)),
    *(Scenario(f"stop_sweep_{s.name}_{launcher or 'joblib'}_{i}", "sweep_stop",
               stop_sweep(s, launcher))
      for s in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT) for launcher in ("", "basic")
      for i in range(2)),
    *(Scenario(f"stop_sweep_main_SIGKILL_{launcher or 'joblib'}_{i}", "sweep_stop",
               stop_sweep(signal.SIGKILL, launcher, group=False))
      for launcher in ("", "basic") for i in range(2)),
]  # fmt: skip
