"""Round 26d's probe cases of the commands' options (issue 48): hydra and omegaconf, OSErrors,
inputs accepted silently and results lost, over the 20 commands; `CASES` is every case of
round 26d (with `tests.probes.cases26d`'s files), run by `tests.probes.harness26d`.

Usage: python -m tests.probes.harness26d [CLASS_OR_ID ...]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.probes.cases26d import (
    MK,
    REAL,
    RUN,
    SIM,
    TINY,
    _hf_cases,
    _st_cases,
    _st_files_cases,
    _summary,
    both,
    hy,
    kept,
    text,
)
from tests.probes.harness26d import CKPT, Case

BAD_YAML = text("cfg/workload/mine.yaml", "batch_size: 2\n\tn_batches: 2\n")  # a tab
XFSZ = "trap '' XFSZ; ulimit -f 2;"  # a file past 2 KiB: EFBIG, a full disk's kind of error


def _hydra_cases() -> list[Case]:
    return [
        hy("interp_missing", "workload.batch_size=${nosuch.key}", names=("nosuch",)),
        hy("interp_cycle", "workload.batch_size=${workload.n_batches}",
           "workload.n_batches=${workload.batch_size}", names=("workload",)),
        hy("interp_ok", "workload.batch_size=${workload.n_batches}", expect="ok"),
        hy("env_missing", "workload.seed=${oc.env:PROBE26D_NOPE}", names=("PROBE26D_NOPE",)),
        hy("env_str", "workload.seed=${oc.env:PROBE26D_S}", names=("seed",),
           extra={"PROBE26D_S": "abc"}),
        hy("resolver_unknown", "workload.seed=${nosuch:1}", names=("nosuch",)),
        hy("decode_bad", "workload.seed=${oc.decode:'[1'}", names=("seed",)),
        hy("plus_unknown", "++workload.extra=1", names=("extra",)),
        hy("plus_existing", "+workload.seed=3", expect="ok"),
        hy("delete_group", "~workload", names=("workload",)),
        hy("delete_key", "~workload.seed", names=("seed",)),
        hy("model_empty", "model=", names=("model",)),
        hy("planner_unknown", "planner=nosuch", names=("nosuch",)),
        hy("executor_unknown", "executor=gpu", names=("executor",)),
        hy("experiment_unknown", "experiment=nosuch", names=("nosuch",)),
        hy("launcher_unknown", "hydra/launcher=nosuch", names=("launcher",)),
        hy("bs_list", "workload.batch_size=[1,2]", names=("batch_size",)),
        hy("bs_dict", "workload.batch_size={a:1}", names=("batch_size",)),
        hy("bs_float", "workload.batch_size=2.5", names=("batch_size",)),
        hy("bs_zero", "workload.batch_size=0", names=("batch_size",)),
        hy("nb_huge", "workload.n_batches=1e30", names=("n_batches",)),
        hy("seed_neg", "workload.seed=-1", names=("seed",)),
        hy("seed_huge", "workload.seed=99999999999999999999999", names=("seed",)),
        hy("gen_zero", "workload.gen_len=0", names=("gen_len",)),
        hy("prompt_zero", "workload.prompt_len=0", names=("prompt_len",)),
        hy("h2d_zero", "hardware.links.h2d.gbps=0", names=("h2d",)),
        hy("h2d_nan", "hardware.links.h2d.gbps=nan", names=("h2d",)),
        hy("h2d_inf", "hardware.links.h2d.gbps=inf", names=("h2d",)),
        hy("lat_neg", "hardware.links.h2d.latency_us=-1", names=("latency_us",)),
        hy("gpu_nan", "hardware.memory_gb.gpu=nan", names=("gpu",)),
        hy("tflops_inf", "hardware.gpu.tflops=inf", names=("tflops",)),
        hy("overhead_nan", "hardware.cpu.overhead_us=nan", names=("overhead_us",)),
    ]  # fmt: skip


def _hydra_value_cases() -> list[Case]:
    return [
        hy("hw_unknown_key", "+hardware.nosuch=1", names=("nosuch",)),
        hy("skew_nan", "workload.routing.skew=nan", names=("skew",)),
        hy("corr_over", "workload.routing.layer_corr=1.5", names=("layer_corr",)),
        hy("reuse_neg", "workload.routing.reuse=-0.1", names=("reuse",)),
        hy("hot_share_over", "workload.routing.hot_share=2", names=("hot_share",)),
        hy("hot_experts_over", "workload.routing.hot_experts=100", "workload.routing.hot_share=0.5",
           names=("hot_experts",)),
        hy("source_unknown", "workload.routing.source=nosuch", names=("source",)),
        hy("tasks_unknown", "model=deepseek-v2-lite", "workload.routing.source=trace",
           "workload.routing.tasks=[nosuch]",
           names=("nosuch",)),
        hy("planner_param_unknown", "planner.params.nosuch=1", names=("nosuch",)),
        hy("topk_over_experts", "model.top_k=5", names=("top_k",)),
        hy("experts_zero", "model.n_experts=0", names=("n_experts",)),
        hy("dtype_bytes_3", "model.dtype_bytes=3", names=("dtype_bytes",)),
        hy("activation_gelu", "model.activation=gelu", names=("activation",)),
        hy("family_unknown", "model.family=nosuch", names=("family",)),
        hy("heads_not_divide", "model.n_kv_heads=3", names=("n_kv_heads",)),
        hy("sweep_dup_values", "-m", "hydra.sweep.dir={t}/sw", "workload.batch_size=2,2",
           names=("batch_size",)),
        hy("sweep_dup_planner", "-m", "hydra.sweep.dir={t}/sw", "planner=flexgen,flexgen",
           names=("planner",)),
        hy("range_zero", "-m", "hydra.sweep.dir={t}/sw", "workload.batch_size=range(0,1)",
           names=("batch_size",)),
        hy("chdir", "hydra.job.chdir=true", names=("chdir",)),
        hy("run_dir_empty", "hydra.run.dir=", names=("hydra.run.dir",)),
        hy("cfg_job", "--cfg", "job", expect="ok"),
        hy("config_name_unknown", "--config-name", "nosuch", names=("nosuch",)),
        hy("config_dir_missing", "--config-dir", "{t}/none", "workload=mine", names=("none",)),
        hy("config_dir_tab", "--config-dir", "{t}/cfg", "workload=mine", names=("mine.yaml",),
           setup=BAD_YAML),
        hy("config_dir_list", "--config-dir", "{t}/cfg", "workload=mine", names=("mine.yaml",),
           setup=text("cfg/workload/mine.yaml", "- 1\n- 2\n")),
        hy("config_dir_pyobj", "--config-dir", "{t}/cfg", "workload=mine",
           names=("mine.yaml",), setup=text("cfg/workload/mine.yaml", "seed: !!python/int 1\n")),
        hy("config_dir_anchor", "--config-dir", "{t}/cfg", "workload=mine", names=("mine.yaml",),
           setup=text("cfg/workload/mine.yaml", "a: &x [*x]\n")),
        hy("config_dir_binary", "--config-dir", "{t}/cfg", "workload=mine", names=("mine.yaml",),
           setup=text("cfg/workload/mine.yaml", b"\x00\xff\x00")),
        hy("hw_file_empty", "hardware={t}/hw.yaml", names=("hw.yaml",), setup=text("hw.yaml", "")),
        hy("hw_file_scalar", "hardware={t}/hw.yaml", names=("hw.yaml",),
           setup=text("hw.yaml", "42\n")),
        hy("hw_file_dir", "hardware={t}/hw.yaml", names=("hw.yaml",),
           setup=lambda t: (t / "hw.yaml").mkdir()),
        hy("model_file_topk", "model={t}/m.yaml", names=("top_k",),
           setup=text("m.yaml", Path("conf/model/tiny.yaml").read_text() + "top_k: 9\n")),
        hy("wl_file_interp", "workload={t}/w.yaml", names=("batch_size", "nosuch"),
           setup=text("w.yaml", "batch_size: ${nosuch}\n")),
        hy("override_syntax", "workload.batch_size=[1,", names=("batch_size",)),
        hy("override_quote", "workload.routing.tasks=['law]", names=("tasks",)),
        hy("key_given_twice", "workload.seed=1", "workload.seed=2", names=("seed",)),
    ]  # fmt: skip


def _fill(t: Path) -> None:
    """A 64 KiB filesystem at `t/full`, nearly full."""
    (t / "full").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(t / "full")], check=1)
    with open(t / "full/filler", "wb") as f, contextlib.suppress(OSError):
        f.write(b"x" * (60 * 1024))


def _ro(t: Path) -> None:
    """A read-only filesystem at `t/ro` (a read-only bind of an empty folder)."""
    (t / "ro").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(t / "ro")], check=1)


def _sweep(t: Path) -> None:
    shutil.copytree(t / "run", t / "sw/a")


def _os_cases() -> list[Case]:
    o = "oserror"
    return [
        Case("os_run_parent_file", o, RUN, (*TINY[:-1], "hydra.run.dir={t}/f/out"),
             setup=text("f", "x"), names=("f",)),
        Case("os_run_full", o, RUN, (*TINY[:-1], "hydra.run.dir={t}/full/out"), setup=_fill,
             names=("full",)),
        Case("os_run_ro", o, RUN, (*TINY[:-1], "hydra.run.dir={t}/ro/out"), setup=_ro,
             names=("ro",)),
        Case("os_run_efbig", o, RUN, TINY, shell=XFSZ, names=("out",)),
        Case("os_real_efbig", o, RUN, REAL, shell=XFSZ, names=("out",)),
        Case("os_mk_full", o, MK, ("model=mixtral-tiny", "out={t}/full/ck", "n_layers=2", *CKPT),
             setup=_fill, names=("full",)),
        Case("os_mk_ro", o, MK, ("model=mixtral-tiny", "out={t}/ro/ck", "n_layers=2", *CKPT),
             setup=_ro, names=("ro",)),
        Case("os_mk_efbig", o, MK, ("model=mixtral-tiny", "out={t}/ck2", "n_layers=2", *CKPT),
             shell=XFSZ, names=("ck2",)),
        Case("os_mk_out_file", o, MK, ("model=mixtral-tiny", "out={t}/f", "n_layers=2", *CKPT),
             setup=text("f", "x"), names=("f",)),
        Case("os_collect_full", o, "experiments.collect", ("dir={t}", "out={t}/full/c"),
             setup=lambda t: (shutil.copytree(t / "run", t / "sw/a"), _fill(t)), names=("full",)),
        Case("os_collect_ro", o, "experiments.collect", ("dir={t}", "out={t}/ro/c"),
             setup=_ro, names=("ro",)),
        Case("os_collect_csv_dir", o, "experiments.collect", ("dir={t}/sw",),
             setup=lambda t: (_sweep(t), (t / "sw/results.csv").mkdir()), names=("results.csv",)),
        Case("os_collect_efbig", o, "experiments.collect", ("dir={t}/sw",), shell=XFSZ,
             setup=_sweep, names=("results",)),
        Case("os_report_ro", o, "experiments.report", ("dir={t}", "out={t}/ro/r"), setup=_ro,
             names=("ro",)),
        Case("os_report_efbig", o, "experiments.report", ("dir={t}",), shell=XFSZ,
             names=("report",)),
        Case("os_report_out_file", o, "experiments.report", ("dir={t}", "out={t}/f"),
             setup=text("f", "x"), names=("f",)),
        Case("os_tj_full", o, "experiments.trace_json", ("runs=[{run}]", "out={t}/full/t.json"),
             setup=_fill, names=("full",)),
        Case("os_tj_json_dir", o, "experiments.trace_json", ("runs=[{run}]",),
             setup=lambda t: (t / "run/trace.json").mkdir(), names=("trace.json",)),
        Case("os_tj_parquet_fifo", o, "experiments.trace_json", ("runs=[{run}]",), timeout=60,
             setup=lambda t: ((t / "run/trace.parquet").unlink(),
                              os.mkfifo(t / "run/trace.parquet")), names=("trace.parquet",)),
        Case("os_tj_efbig", o, "experiments.trace_json", ("runs=[{run}]",), shell=XFSZ,
             names=("trace.json",)),
        Case("os_ckpt_is_file", o, RUN, ("executor=real", "checkpoint={t}/f", *SIM),
             setup=text("f", "x"), names=("f",)),
        Case("os_ckpt_missing", o, RUN, ("executor=real", "checkpoint={t}/none", *SIM),
             names=("none",)),
        Case("os_real_ro_ckpt", o, RUN, REAL, expect="ok",
             setup=lambda t: subprocess.run(["mount", "--bind", "-o", "ro", str(t / "ck"),
                                             str(t / "ck")], check=1)),
        Case("os_stats_out_dir", o, "experiments.routing_stats", ("out={t}",), names=("out",),
             timeout=400),
        Case("os_convert_src_missing", o, "experiments.convert_traces",
             ("src={t}/none", "out={t}/o"), names=("none",)),
        Case("os_convert_out_ro", o, "experiments.convert_traces",
             ("src={t}/none", "out={t}/ro/o"), setup=_ro, names=("ro",)),
        Case("os_calibrate_out_ro", o, "experiments.calibrate",
             ("out={t}/ro/h.yaml", "disk_mb=1"), setup=_ro, names=("ro",)),
        Case("os_calibrate_disk_full", o, "experiments.calibrate",
             ("out={t}/h.yaml", "disk_dir={t}/full", "disk_mb=1"), setup=_fill,
             names=("full",)),
        Case("os_klotski_out_file", o, "experiments.reproduce_klotski",
             ("out={t}/f", "quick=true", "only=[table3]"), setup=text("f", "x"), names=("f",)),
        Case("os_prefetch_out_dir", o, "experiments.prefetch_eval", ("out={t}", "group_seqs=2"),
             names=("out",), timeout=400),
    ]  # fmt: skip


def _bad_summary(**changes: Any) -> Any:
    return _summary(lambda s: s.update(changes))


s, col, rep, tj = "silent", "experiments.collect", "experiments.report", "experiments.trace_json"


def trace(edit: str) -> Any:
    def setup(t: Path) -> None:
        import pandas as pd

        path = t / "run/trace.parquet"
        df = pd.read_parquet(path)
        exec(edit, {"df": df, "pd": pd})  # noqa: S102 (the case's own edit)
        df.to_parquet(path)

    return setup


def _silent_cases() -> list[Case]:
    return [
        Case("si_collect_makespan_neg", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(makespan_s=-1.0)),
        Case("si_collect_tps_inf", s, col, ("dir={t}",), names=("summary.json",),
             setup=_summary(lambda x: json.dumps(x).replace(
                 f'"throughput_tok_s": {json.dumps(x["throughput_tok_s"])}',
                 '"throughput_tok_s": Infinity'))),
        Case("si_collect_ops_float", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(ops=1.5)),
        Case("si_collect_bool_metric", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(makespan_s=True)),
        Case("si_collect_summary_list", s, col, ("dir={t}",), names=("summary.json",),
             setup=_summary(lambda x: "[]")),
        Case("si_collect_summary_empty", s, col, ("dir={t}",), names=("summary.json",),
             setup=_summary(lambda x: "")),
        Case("si_collect_no_makespan", s, col, ("dir={t}",), names=("summary.json",),
             setup=_summary(lambda x: x.pop("makespan_s"))),
        Case("si_collect_planner_other", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(planner="klotski")),
        Case("si_collect_model_other", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(model="mixtral-8x7b")),
        Case("si_collect_bs_other", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(batch_size=64)),
        Case("si_collect_eff_over", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(efficiency=1.7)),
        Case("si_collect_tokens_other", s, col, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(tokens_generated=999)),
        Case("si_collect_config_edit", s, col, ("dir={t}",), names=("config.yaml",),
             setup=lambda t: (t / "run/config.yaml").write_text(
                 (t / "run/config.yaml").read_text().replace("batch_size: 2", "batch_size: 8"))),
        Case("si_collect_config_gone", s, col, ("dir={t}",), names=("config.yaml",),
             setup=lambda t: (t / "run/config.yaml").unlink()),
        Case("si_collect_trace_other", s, col, ("dir={t}/sw",), expect="ok",  # reads no trace
             setup=lambda t: _swapped_traces(t)),
    ]  # fmt: skip


def _silent_report_cases() -> list[Case]:
    return [
        Case("si_report_makespan_str", s, rep, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(makespan_s="fast")),
        Case("si_report_metric_unknown", s, rep, ("dir={t}", "metric=nosuch"), names=("nosuch",)),
        Case("si_report_columns_unknown", s, rep, ("dir={t}", "columns=[nosuch]"),
             names=("nosuch",)),
        Case("si_report_busy_neg", s, rep, ("dir={t}",), names=("summary.json",),
             setup=_summary(lambda x: x["busy_s"].update(gpu=-1.0))),
        Case("si_report_bubble_over", s, rep, ("dir={t}",), names=("summary.json",),
             setup=_bad_summary(gpu_bubble_frac=3.0)),
        Case("si_tj_start_nan", s, tj, ("runs=[{run}]",), names=("start_s",),
             setup=trace("df.loc[0, 'start_s'] = float('nan')")),
        Case("si_tj_end_before", s, tj, ("runs=[{run}]",), names=("end_s",),
             setup=trace("df.loc[0, 'end_s'] = df.loc[0, 'start_s'] - 1")),
        Case("si_tj_dup_op", s, tj, ("runs=[{run}]",), names=("op_id",),
             setup=trace("df.loc[1, 'op_id'] = df.loc[0, 'op_id']")),
        Case("si_tj_empty", s, tj, ("runs=[{run}]",), names=("trace.parquet",),
             setup=trace("df.drop(df.index, inplace=True)")),
        Case("si_tj_col_missing", s, tj, ("runs=[{run}]",), names=("stream",),
             setup=trace("df.drop(columns=['stream'], inplace=True)")),
        Case("si_tj_kind_unknown", s, tj, ("runs=[{run}]",), names=("kind",),
             setup=trace("df['kind'] = df['kind'].astype(str); df.loc[0, 'kind'] = 'zzz'")),
        Case("si_tj_start_str", s, tj, ("runs=[{run}]",), names=("start_s",),
             setup=trace("df['start_s'] = df['start_s'].astype(str)")),
        Case("si_tj_rows_dropped", s, tj, ("runs=[{run}]",), names=("trace.parquet",),
             setup=trace("df.drop(df.index[-3:], inplace=True)")),
        Case("si_tj_runs_empty", s, tj, ("runs=[]",), names=("runs",)),
        Case("si_tj_runs_dup", s, tj, ("runs=[{run},{run}]",), names=("run",)),
    ]  # fmt: skip


def _silent_real_cases() -> list[Case]:
    return [
        Case("si_real_bs_huge_prompt", s, RUN, (*REAL, "workload.prompt_len=5000"),
             expect="ok"),  # a warning, as transformers runs it
        Case("si_real_trace_other_model", s, RUN, (*REAL, "workload.routing.source=trace"),
             names=("trace",)),
        Case("si_real_dtype_bad", s, RUN, (*REAL, "executor.dtype=float64"), names=("dtype",)),
        Case("si_real_device_bad", s, RUN, (*REAL, "executor.device=tpu"), names=("device",)),
        Case("si_real_live_trace", s, RUN, (*REAL, "executor.routing_mode=live",
                                            "workload.routing.source=trace"), names=("trace",)),
        Case("si_mk_topk_over", s, MK, ("model=mixtral-tiny", "out={t}/c", "top_k=9"),
             names=("top_k",)),
        Case("si_mk_seed_neg", s, MK, ("model=mixtral-tiny", "out={t}/c", "seed=-1"),
             names=("seed",)),
        Case("si_mk_shard_zero", s, MK, ("model=mixtral-tiny", "out={t}/c", "shard_mb=0"),
             names=("shard_mb",)),
        Case("si_mk_scale_nan", s, MK, ("model=mixtral-tiny", "out={t}/c", "scale=nan"),
             names=("scale",)),
        Case("si_mk_unknown", s, MK, ("model=mixtral-tiny", "out={t}/c", "hidden=64"),
             names=("hidden",)),
        Case("si_mk_kv_over", s, MK, ("model=mixtral-tiny", "out={t}/c", "n_kv_heads=64"),
             names=("n_kv_heads",)),
        Case("si_mk_rope_unknown", s, MK, ("model=mixtral-tiny", "out={t}/c",
                                           "rope_scaling={type: nosuch, factor: 2}"),
             names=("rope_scaling",)),
        Case("si_mk_moe_layers_out", s, MK, ("model=mixtral-tiny", "out={t}/c", "n_layers=2",
                                             "moe_layers=[0,5]"), names=("moe_layers",)),
    ]  # fmt: skip


def _silent_option_cases() -> list[Case]:
    return [
        Case("si_calib_name_slash", s, "experiments.calibrate", ("hardware.name=a/b",),
             names=("hardware.name",)),
        Case("si_calib_name_empty", s, "experiments.calibrate", ("hardware.name=",),
             names=("hardware.name",)),
        Case("si_calib_disk_zero", s, "experiments.calibrate", ("disk_mb=0",),
             names=("disk_mb",)),
        Case("si_calib_in_run_neg", s, "experiments.calibrate", ("in_run_s=-1",),
             names=("in_run_s",)),
        Case("si_validate_planner_unknown", s, "experiments.validate", ("checkpoint={ck}",
              "planners=[nosuch]"),
             names=("nosuch",)),
        Case("si_validate_frac_over", s, "experiments.validate", ("checkpoint={ck}",
              "gpu_frac=65"),
             names=("gpu_frac",)),
        Case("si_validate_repeats_zero", s, "experiments.validate", ("checkpoint={ck}",
              "repeats=0"),
             names=("repeats",)),
        Case("si_validate_links_unknown", s, "experiments.validate", ("links=nosuch",),
             names=("links",)),
        Case("si_stats_seed_neg", s, "experiments.routing_stats", ("seed=-1", "out={t}/s.json"),
             names=("seed",)),
        Case("si_stats_trace_empty", s, "experiments.routing_stats",
             ("trace_dir={t}/e", "out={t}/s.json"), setup=lambda t: (t / "e").mkdir(),
             names=("e",)),
        Case("si_prefetch_k_neg", s, "experiments.prefetch_eval", ("k=-1",), names=("k",)),
        Case("si_prefetch_group_zero", s, "experiments.prefetch_eval", ("group_seqs=0",),
             names=("group_seqs",)),
        Case("si_prefetch_overlap", s, "experiments.prefetch_eval", ("train=[law]", "test=[law]"),
             names=("law",)),
        Case("si_prefetch_task_unknown", s, "experiments.prefetch_eval", ("test=[nosuch]",),
             names=("nosuch",)),
        Case("si_klotski_only_unknown", s, "experiments.reproduce_klotski", ("only=[nosuch]",),
             names=("nosuch",)),
        Case("si_klotski_jobs_zero", s, "experiments.reproduce_klotski", ("jobs=0",),
             names=("jobs",)),
        Case("si_repl_cases_unknown", s, "experiments.replication", ("cases=[nosuch]",),
             names=("nosuch",)),
        Case("si_repl_dir_missing", s, "experiments.replication", ("dir={t}/none",),
             names=("none",)),
        Case("si_repl_cv_dir_missing", s, "experiments.replication_cv", ("dir={t}/none",),
             names=("none",)),
        Case("si_bench_sim_repeat_zero", s, "experiments.bench.sim", ("repeat=0",),
             names=("repeat",)),
        Case("si_bench_sim_planner", s, "experiments.bench.sim", ("planner=nosuch",),
             names=("nosuch",)),
        Case("si_bench_host_cpu", s, "experiments.bench.host", ("units=0",), names=("units",)),
        Case("si_bench_lanes_nocuda", s, "experiments.bench.lanes", (), expect="ok"),  # model only
        Case("si_validate_lanes_nocuda", s, "experiments.validate_lanes", ("checkpoint={ck}",
              "lanes=0"),
             names=("lanes",)),
        Case("si_bench_real_budget", s, "experiments.bench.real", ("model=tiny", "budget_gb=-1"),
             names=("budget_gb",)),
        Case("si_bench_acc_unknown", s, "experiments.bench.accelerate", ("nosuch=1",),
             names=("nosuch",)),
        Case("si_torchrun_bad", s, "experiments.torchrun", ("--nproc-per-node=0", "-m",
                                                            "experiments.run"), names=("nproc",)),
    ]  # fmt: skip


def _repeat_cases() -> list[Case]:
    """A list option naming one item twice, and values of the right type that mean nothing."""
    s, v = "silent", "experiments.validate"
    ds = ("model=deepseek-v2-lite", "workload.routing.source=trace")
    return [
        hy("tasks_twice", *ds, "workload.routing.tasks=[law,law]", names=("law",)),
        hy("tasks_and_excluded", *ds, "workload.routing.tasks=[law]",
           "workload.routing.exclude_tasks=[law]", names=("law",)),
        hy("exclude_all", *ds, "workload.routing.exclude_tasks=[law,summary,translation,intent]",
           names=("exclude_tasks",)),
        hy("exclude_unknown", *ds, "workload.routing.exclude_tasks=[nosuch]", names=("nosuch",)),
        hy("moe_layers_twice", "model.moe_layers=[0,0]", names=("moe_layers",)),
        hy("moe_layers_out", "model.moe_layers=[0,7]", names=("moe_layers",)),
        hy("n_gpus_zero", "hardware.n_gpus=0", names=("n_gpus",)),
        hy("hot_no_share", "workload.routing.hot_experts=2", "workload.routing.hot_share=0.0",
           names=("hot",)),
        hy("share_no_hot", "workload.routing.hot_share=0.5", names=("hot",)),
        hy("rdzv_zero", "executor=real", "checkpoint={ck}", "executor.rendezvous_timeout_s=0",
           names=("rendezvous_timeout_s",)),
        hy("sweep_params_twice", "-m", "hydra.sweep.dir={t}/sw", "planner=klotski",
           "planner.params.hot_k=1,1", names=("hot_k",)),
        Case("si_validate_planner_twice", s, v, ("planners=[flexgen,flexgen]",),
             names=("flexgen",)),
        Case("si_validate_gpu_frac_zero", s, v, ("checkpoint={ck}", "gpu_frac=0"),
             names=("gpu_frac",)),
        Case("si_validate_cpu_frac_nan", s, v, ("checkpoint={ck}", "cpu_frac=nan"),
             names=("cpu_frac",)),
        Case("si_validate_lanes_none", s, "experiments.validate_lanes", ("checkpoint={ck}",
                                                                  "planners=[]"),
             names=("planners",)),
        Case("si_report_columns_twice", s, "experiments.report",
             ("dir={t}", "columns=[makespan_s,makespan_s]"), names=("makespan_s",)),
        Case("si_prefetch_train_twice", s, "experiments.prefetch_eval", ("train=[law,law]",),
             names=("law",)),
        Case("si_prefetch_k_huge", s, "experiments.prefetch_eval", ("k=1000",), names=("k",)),
        Case("si_klotski_only_twice", s, "experiments.reproduce_klotski",
             ("only=[table3,table3]", "out={t}/k", "quick=true"), names=("table3",)),
        Case("si_repl_cases_twice", s, "experiments.replication",
             ("cases=[esft-g8,esft-g8]", "dir={t}/r"), names=("esft-g8",)),
        Case("si_mk_moe_layers_twice", s, MK, ("model=mixtral-tiny", "out={t}/c",
                                               "moe_layers=[0,0]"), names=("moe_layers",)),
        Case("si_mk_moe_layers_unordered", s, MK, ("model=qwen1.5-moe-a2.7b", "out={t}/c",
                                                   "n_layers=3", "moe_layers=[2,0]",
                                                   "hidden_size=64", "n_heads=4",
                                                   "n_kv_heads=4", "expert_ffn_size=32",
                                                   "vocab_size=128", "dense_ffn_size=64"),
             names=("moe_layers",)),
        Case("si_tj_runs_same_dir", s, "experiments.trace_json", ("runs=[{run},{run}/.]",),
             names=("run",)),
        Case("si_stats_seed_huge", s, "experiments.routing_stats", ("seed=1e30",),
             names=("seed",)),
    ]  # fmt: skip


def _swapped_traces(t: Path) -> None:
    shutil.copytree(t / "run", t / "sw/a")
    subprocess.run(
        ["python", "-m", "experiments.run", *TINY[:3], "planner=sequential",
         f"hydra.run.dir={t}/sw/b"], check=True, capture_output=True,
    )  # fmt: skip
    a, b = t / "sw/a/trace.parquet", t / "sw/b/trace.parquet"
    tmp = t / "sw/x"
    os.replace(a, tmp), os.replace(b, a), os.replace(tmp, b)


def _lost_cases() -> list[Case]:
    lo, col, rep = "lost", "experiments.collect", "experiments.report"
    mine = "my notes\n"
    return [
        Case("lo_collect_user_csv", lo, col, ("dir={t}",), expect="ok",
             setup=text("run/results.csv", mine), after=kept("run/results.csv", mine)),
        Case("lo_collect_out_user_file", lo, col, ("dir={t}", "out={t}/mine.csv"),
             setup=text("mine.csv", mine), after=kept("mine.csv", mine), names=("mine.csv",)),
        Case("lo_report_user_html", lo, rep, ("dir={t}", "out={t}/site"), names=("index.html",),
             setup=text("site/index.html", mine), after=kept("site/index.html", mine)),
        Case("lo_report_out_is_run", lo, rep, ("dir={t}/run", "out={run}"), names=("run's",),
             after=lambda t: None if (t / "run/summary.json").is_file() else "lost"),
        Case("lo_tj_out_summary", lo, "experiments.trace_json", ("runs=[{run}]",
                                                                 "out={run}/summary.json"),
             names=("summary.json",),
             after=lambda t: None if "makespan_s" in (t / "run/summary.json").read_text()
             else "lost"),
        Case("lo_tj_out_user", lo, "experiments.trace_json", ("runs=[{run}]", "out={t}/mine.txt"),
             setup=text("mine.txt", mine), after=kept("mine.txt", mine), names=("JSON",)),
        Case("lo_mk_over_run", lo, MK, ("model=mixtral-tiny", "out={run}"), names=("summary",),
             after=lambda t: None if (t / "run/summary.json").is_file() else "lost"),
        Case("lo_mk_user_readme", lo, MK, ("model=mixtral-tiny", "out={ck}", "n_layers=2", *CKPT),
             setup=text("ck/README.md", mine), after=kept("ck/README.md", mine), expect="ok"),
        Case("lo_calib_over_shipped", lo, "experiments.calibrate", ("hardware.name=tiny",),
             names=("tiny",), after=lambda t: None if "invented round numbers" in
             Path("conf/hardware/tiny.yaml").read_text() else "lost"),
        Case("lo_calib_out_user", lo, "experiments.calibrate", ("out={t}/mine.yaml",),
             setup=text("mine.yaml", mine), names=("mine.yaml",),
             after=kept("mine.yaml", mine)),
        Case("lo_run_into_ckpt", lo, RUN, (*TINY[:-1], "hydra.run.dir={ck}"),
             names=("checkpoint's",),
             after=lambda t: None if (t / "ck/config.json").is_file() else "lost"),
        Case("lo_collect_out_ckpt", lo, col, ("dir={t}", "out={ck}"), names=("checkpoint's",)),
        Case("lo_report_out_ckpt", lo, rep, ("dir={t}", "out={ck}"), names=("checkpoint's",)),
        Case("lo_real_into_other_ckpt", lo, RUN, (*REAL[:-1], "hydra.run.dir={t}/ck2"),
             setup=lambda t: shutil.copytree(t / "ck", t / "ck2"), names=("checkpoint's",)),
        Case("lo_run_rerun_other", lo, RUN, (*TINY[:3], "planner=sequential",
                                             "hydra.run.dir={run}"), expect="ok",
             after=lambda t: None if (t / "run/summary.json").is_file() else "lost"),
        Case("lo_run_rerun_fails", lo, RUN, (*TINY[:-1], "workload.batch_size=0",
                                             "hydra.run.dir={run}"), names=("batch_size",),
             after=lambda t: None if (t / "run/summary.json").is_file() else "lost"),
        Case("lo_run_rerun_efbig", lo, RUN, (*TINY[:3], "planner=sequential",
                                             "hydra.run.dir={run}"), shell=XFSZ,
             names=("run",),
             after=lambda t: None if (t / "run/summary.json").is_file() else "lost"),
        Case("lo_convert_over_shared", lo, "experiments.convert_traces",
             ("src={t}/none", "out=../shared/traces/esft-dsv2lite"), names=("folder",)),
        Case("lo_stats_over_summary", lo, "experiments.routing_stats",
             ("out={run}/summary.json",), names=("summary.json",), timeout=400,
             after=lambda t: None if "makespan_s" in (t / "run/summary.json").read_text()
             else "lost"),
        Case("lo_klotski_over_run", lo, "experiments.reproduce_klotski",
             ("out={run}", "report_only=true"), names=("run",),
             after=lambda t: None if (t / "run/summary.json").is_file() else "lost"),
    ]  # fmt: skip


_ = both  # helpers a case list may use
CASES = _hf_cases() + _st_cases() + _st_files_cases() + _hydra_cases() + _hydra_value_cases()
CASES += _os_cases() + _silent_cases() + _silent_report_cases() + _silent_real_cases()
CASES += _silent_option_cases()
CASES += _lost_cases() + _repeat_cases()
